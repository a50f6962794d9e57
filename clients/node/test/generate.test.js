// Starts `lucekv serve` on a tiny synthetic model and checks the Node client against the engine's own output.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync, spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { LucekvClient, status } from '../lucekv.js';

const REPO_ROOT = fileURLToPath(new URL('../../..', import.meta.url));
const PYTHON = process.env.LUCEKV_PYTHON ?? path.join(REPO_ROOT, '.venv', 'bin', 'python');
const PROMPT = 'The quick brown fox';
const SAMPLING = { temperature: 0.8, top_k: 40, seed: 11, max_tokens: 12, ignore_eos: true };

// Writes the model and prints what the engine itself generates for PROMPT with SAMPLING.
const REFERENCE = `
import json, sys, lucekv
from lucekv.model.synth import write_synthetic_gguf
path = write_synthetic_gguf(sys.argv[1], "llama")
deltas = list(lucekv.load(path, backend="cpu").generate(sys.argv[2], lucekv.SamplingParams(**json.loads(sys.argv[3]))))
print(json.dumps({"text": "".join(d.text for d in deltas), "ids": [t for d in deltas for t in d.token_ids]}))
`;

let tmp;
let server;
let client;
let expected;

before(async () => {
  tmp = mkdtempSync(path.join(os.tmpdir(), 'lucekv-node-'));
  const model = path.join(tmp, 'tiny-llama.gguf');
  const args = ['-c', REFERENCE, model, PROMPT, JSON.stringify(SAMPLING)];
  expected = JSON.parse(execFileSync(PYTHON, args, { cwd: REPO_ROOT, encoding: 'utf8' }));
  server = spawn(PYTHON, ['-m', 'lucekv.cli', 'serve', '--model', model, '--port', '0'], {
    cwd: REPO_ROOT,
    stdio: ['ignore', 'inherit', 'pipe'],
  });
  client = new LucekvClient(await serverAddress(server, 120_000));
});

after(() => {
  client?.close();
  server?.kill('SIGTERM');
  rmSync(tmp, { recursive: true, force: true });
});

// Resolves with the address from the server's "lucekv: serving ... on HOST:PORT" line.
function serverAddress(child, timeoutMs) {
  return new Promise((resolve, reject) => {
    let log = '';
    const timer = setTimeout(() => reject(new Error(`no server after ${timeoutMs} ms:\n${log}`)), timeoutMs);
    child.stderr.setEncoding('utf8');
    child.stderr.on('data', (data) => {
      log += data;
      const match = log.match(/lucekv: serving .* on (\S+:\d+)/);
      if (match) {
        clearTimeout(timer);
        resolve(match[1]);
      }
    });
    child.on('exit', (code) => reject(new Error(`server exited with ${code}:\n${log}`)));
  });
}

test('streamed completion equals the engine output for the same seed', async () => {
  const chunks = [];
  for await (const chunk of client.generate(PROMPT, SAMPLING, { requestId: 'node-1' })) {
    chunks.push(chunk);
  }
  assert.equal(chunks.map((c) => c.text).join(''), expected.text);
  assert.deepEqual(chunks.flatMap((c) => c.token_ids), expected.ids);
  assert.ok(chunks.every((c) => c.request_id === 'node-1'));
  const last = chunks.at(-1);
  assert.equal(last.finish_reason, 'FINISH_REASON_LENGTH');
  assert.equal(last.usage.completion_tokens, SAMPLING.max_tokens);
  assert.ok(last.usage.time_to_first_token_ms > 0);
});

test('server info describes the model', async () => {
  const info = await client.serverInfo();
  assert.equal(info.arch, 'llama');
  assert.equal(info.context_length, 512);
  assert.ok(info.features.includes('logprobs'));
});

test('tokenize and detokenize round-trip', async () => {
  const ids = await client.tokenize(PROMPT, false);
  assert.ok(ids.length > 1);
  assert.equal(await client.detokenize(ids), PROMPT);
});

test('a bad parameter is INVALID_ARGUMENT naming the field', async () => {
  await assert.rejects(client.complete(PROMPT, { temperature: -1 }), (error) => {
    assert.equal(error.code, status.INVALID_ARGUMENT);
    assert.match(error.details, /^temperature: /);
    return true;
  });
});

test('cancelling a stream after 3 chunks leaves the server ready for the next call', async () => {
  const call = client.generate(PROMPT, { max_tokens: 400, ignore_eos: true });
  let received = 0;
  await assert.rejects(
    (async () => {
      for await (const _chunk of call) {
        if (++received === 3) call.cancel();
      }
    })(),
    (error) => error.code === status.CANCELLED,
  );
  assert.equal(received, 3);
  const next = await client.complete(PROMPT, { max_tokens: 4, ignore_eos: true }, { deadlineMs: 30_000 });
  assert.equal(next.tokenIds.length, 4);
});
