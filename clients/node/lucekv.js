// A small client for the lucekv gRPC service. The service is loaded from protos/ at run time, so there is no
// generated code to keep in step with the proto. Field names are the proto's (snake_case), enums are strings.
import { fileURLToPath } from 'node:url';
import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

export const DEFAULT_ADDRESS = '127.0.0.1:50051';
// A proxy in front of several replicas hashes this metadata key so a conversation's turns reach one replica.
export const SESSION_METADATA = 'lucekv-session-id';
export const { status } = grpc;

const PROTO_ROOT = fileURLToPath(new URL('../../protos', import.meta.url));
const definition = protoLoader.loadSync('lucekv/v1/lucekv.proto', {
  includeDirs: [PROTO_ROOT],
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
});
const { LuceKV } = grpc.loadPackageDefinition(definition).lucekv.v1;

export class LucekvClient {
  // `token`: the bearer token of a server started with --auth-tokens. `tls`: {ca, cert, key} as PEM Buffers
  // (ca: the CA that signed the server's certificate; cert and key: this client's, for mTLS); without it the
  // connection is plaintext.
  constructor(address = DEFAULT_ADDRESS, { token, tls } = {}) {
    const credentials = tls
      ? grpc.credentials.createSsl(tls.ca ?? null, tls.key ?? null, tls.cert ?? null)
      : grpc.credentials.createInsecure();
    this.stub = new LuceKV(address, credentials);
    this.token = token;
  }

  // Streams GenerateResponse chunks: `for await (const chunk of client.generate(...))`. `prompt` is text, an
  // array of token ids, or an array of {role, content} messages; `sampling` holds SamplingParams fields
  // (unset ones take the server's defaults); `sessionId` continues (or starts) a session. The returned call has
  // cancel(), which stops the generation.
  generate(prompt, sampling = {}, { requestId = '', sessionId = '', deadlineMs } = {}) {
    const request = { ...generateRequest(prompt, sampling, requestId), session_id: sessionId };
    return this.stub.Generate(request, this.#metadata(sessionId), callOptions(deadlineMs));
  }

  // Generates and collects: {text, tokenIds, finishReason, usage, requestId}.
  async complete(prompt, sampling = {}, options = {}) {
    const completion = { text: '', tokenIds: [] };
    for await (const chunk of this.generate(prompt, sampling, options)) {
      completion.text += chunk.text;
      completion.tokenIds.push(...chunk.token_ids);
      Object.assign(completion, { finishReason: chunk.finish_reason, usage: chunk.usage, requestId: chunk.request_id });
    }
    return completion;
  }

  async tokenize(text, addSpecialTokens = true) {
    const response = await this.#unary('Tokenize', { text, add_special_tokens: addSpecialTokens });
    return response.token_ids;
  }

  async detokenize(tokenIds, skipSpecialTokens = false) {
    const response = await this.#unary('Detokenize', { token_ids: tokenIds, skip_special_tokens: skipSpecialTokens });
    return response.text;
  }

  serverInfo() {
    return this.#unary('GetServerInfo', {});
  }

  getSession(sessionId) {
    return this.#unary('GetSession', { session_id: sessionId }, undefined, sessionId);
  }

  async listSessions() {
    return (await this.#unary('ListSessions', {})).sessions;
  }

  async deleteSession(sessionId) {
    await this.#unary('DeleteSession', { session_id: sessionId }, undefined, sessionId);
  }

  close() {
    this.stub.close();
  }

  #unary(method, request, deadlineMs, sessionId = '') {
    return new Promise((resolve, reject) => {
      this.stub[method](request, this.#metadata(sessionId), callOptions(deadlineMs),
        (error, response) => (error ? reject(error) : resolve(response)));
    });
  }

  #metadata(sessionId) {
    const metadata = new grpc.Metadata();
    if (this.token) metadata.set('authorization', `Bearer ${this.token}`);
    if (sessionId) metadata.set(SESSION_METADATA, sessionId);
    return metadata;
  }
}

export function generateRequest(prompt, sampling = {}, requestId = '') {
  const request = { sampling, request_id: requestId };
  if (typeof prompt === 'string') {
    request.text = prompt;
  } else if (prompt.length > 0 && prompt.every((item) => typeof item === 'object')) {
    request.messages = { messages: prompt };
  } else {
    request.token_ids = { ids: prompt };
  }
  return request;
}

function callOptions(deadlineMs) {
  return deadlineMs === undefined ? {} : { deadline: Date.now() + deadlineMs };
}
