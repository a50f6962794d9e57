// The Node client against a server with bearer tokens and mTLS: certificates made here with openssl.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync, spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { LucekvClient, status } from '../lucekv.js';

const REPO_ROOT = fileURLToPath(new URL('../../..', import.meta.url));
const PYTHON = process.env.LUCEKV_PYTHON ?? path.join(REPO_ROOT, '.venv', 'bin', 'python');
const TOKEN = 'node-test-token-0123456789';
const GREEDY = { temperature: 0, max_tokens: 4, ignore_eos: true };

let tmp;
let server;
let port;
let pem;

function openssl(...args) {
  execFileSync('openssl', args, { cwd: tmp, stdio: 'pipe' });
}

// A CA, and a certificate it signs for `name` (with a DNS name when given).
function makeCertificates() {
  const ec = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes'];
  openssl('req', '-x509', ...ec, '-keyout', 'ca.key', '-out', 'ca.pem', '-days', '1', '-subj', '/CN=node test CA');
  for (const [name, dns] of [['server', 'localhost'], ['client', null]]) {
    openssl('req', ...ec, '-keyout', `${name}.key`, '-out', `${name}.csr`, '-subj', `/CN=${name}`);
    writeFileSync(path.join(tmp, `${name}.ext`), dns ? `subjectAltName=DNS:${dns}\n` : 'basicConstraints=CA:FALSE\n');
    openssl('x509', '-req', '-in', `${name}.csr`, '-CA', 'ca.pem', '-CAkey', 'ca.key', '-CAcreateserial',
      '-out', `${name}.pem`, '-days', '1', '-extfile', `${name}.ext`);
  }
  const read = (name) => readFileSync(path.join(tmp, name));
  return { ca: read('ca.pem'), cert: read('client.pem'), key: read('client.key') };
}

before(async () => {
  tmp = mkdtempSync(path.join(os.tmpdir(), 'lucekv-node-secure-'));
  pem = makeCertificates();
  const model = path.join(tmp, 'tiny-llama.gguf');
  execFileSync(PYTHON, ['-c', 'import sys; from lucekv.model.synth import write_synthetic_gguf; '
    + 'write_synthetic_gguf(sys.argv[1], "llama")', model], { cwd: REPO_ROOT });
  writeFileSync(path.join(tmp, 'tokens'), `node ${TOKEN}\n`);
  const file = (name) => path.join(tmp, name);
  server = spawn(PYTHON, ['-m', 'lucekv.cli', 'serve', '--model', model, '--port', '0', '--auth-tokens',
    file('tokens'), '--tls-cert', file('server.pem'), '--tls-key', file('server.key'), '--tls-client-ca',
    file('ca.pem')], { cwd: REPO_ROOT, stdio: ['ignore', 'inherit', 'pipe'] });
  port = await new Promise((resolve, reject) => {
    let log = '';
    const timer = setTimeout(() => reject(new Error(`no server after 120 s:\n${log}`)), 120_000);
    server.stderr.setEncoding('utf8');
    server.stderr.on('data', (data) => {
      log += data;
      const match = log.match(/lucekv: serving .* on \S+:(\d+)/);
      if (match) {
        clearTimeout(timer);
        resolve(match[1]);
      }
    });
    server.on('exit', (code) => reject(new Error(`server exited with ${code}:\n${log}`)));
  });
});

after(() => {
  server?.kill('SIGTERM');
  rmSync(tmp, { recursive: true, force: true });
});

test('with its token and certificate a client generates in a session and manages it', async () => {
  const client = new LucekvClient(`localhost:${port}`, { token: TOKEN, tls: pem });
  try {
    const first = await client.complete('Hello', GREEDY, { sessionId: 'node-chat' });
    assert.equal(first.tokenIds.length, 4);
    const again = await client.complete('Hello', GREEDY, { sessionId: 'node-chat' });
    assert.ok(Number(again.usage.cached_tokens) > 0);
    assert.deepEqual((await client.listSessions()).map((s) => s.session_id), ['node-chat']);
    assert.equal((await client.getSession('node-chat')).session_id, 'node-chat');
    await client.deleteSession('node-chat');
    assert.deepEqual(await client.listSessions(), []);
  } finally {
    client.close();
  }
});

test('a wrong token is UNAUTHENTICATED', async () => {
  const client = new LucekvClient(`localhost:${port}`, { token: 'not-the-token-0123456789', tls: pem });
  try {
    await assert.rejects(client.serverInfo(), (error) => error.code === status.UNAUTHENTICATED);
  } finally {
    client.close();
  }
});

test('without a client certificate the TLS handshake fails: UNAVAILABLE', async () => {
  const client = new LucekvClient(`localhost:${port}`, { token: TOKEN, tls: { ca: pem.ca } });
  try {
    await assert.rejects(client.serverInfo(), (error) => error.code === status.UNAVAILABLE);
  } finally {
    client.close();
  }
});
