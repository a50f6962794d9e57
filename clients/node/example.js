// Streams a completion from a running lucekv server (start one with `lucekv serve` or `make serve`).
// usage: node example.js ["PROMPT"] [ADDRESS]
import { LucekvClient } from './lucekv.js';

const [prompt = 'Write a haiku about the sea.', address] = process.argv.slice(2);
const client = new LucekvClient(address);
try {
  const info = await client.serverInfo();
  console.error(`${info.model_name} (${info.arch}, ${info.backend}) at ${address ?? 'the default address'}`);
  const messages = [{ role: 'user', content: prompt }];
  const sampling = { max_tokens: 128, temperature: 0.7, seed: 1 };
  const chat = info.features.includes('chat_template');
  for await (const chunk of client.generate(chat ? messages : prompt, sampling)) {
    process.stdout.write(chunk.text);
    if (chunk.usage) {
      const u = chunk.usage;
      console.error(`\n[${chunk.finish_reason}: ${u.completion_tokens} tokens, first after ` +
        `${u.time_to_first_token_ms.toFixed(0)} ms, ${u.decode_tokens_per_second.toFixed(1)} tok/s]`);
    }
  }
} catch (error) {
  console.error(`lucekv: ${error.details ?? error.message}`);
  process.exitCode = 1;
} finally {
  client.close();
}
