// Times the npm reference tokenizers on the parity fixtures, as bench/tokenizer_bench.cpp times
// loom: encode MB/s (median of 3) on the Bible and on the Unicode text.
//   node bench/tokenizer_bench.mjs FIXTURE_DIR
// gpt-tokenizer keeps an LRU cache of encoded pieces across calls; it is cleared before every
// run, so that each run starts cold like loom's per-call cache.
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const dir = process.argv[2];
if (!dir) throw new Error('usage: node bench/tokenizer_bench.mjs FIXTURE_DIR');
const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const mod = (p) => import(pathToFileURL(path.join(root, 'tests/tokenizer/node_modules', p)).href);

const gpt = {
  r50k: await mod('gpt-tokenizer/esm/encoding/r50k_base.js'),
  cl100k: await mod('gpt-tokenizer/esm/encoding/cl100k_base.js'),
  o200k: await mod('gpt-tokenizer/esm/encoding/o200k_base.js'),
};
const llama3 = (await mod('llama3-tokenizer-js/bundle/llama3-tokenizer-with-baked-data.js')).default;

const encoders = {
  r50k: (s) => { gpt.r50k.clearMergeCache(); return gpt.r50k.encode(s); },
  cl100k: (s) => { gpt.cl100k.clearMergeCache(); return gpt.cl100k.encode(s); },
  o200k: (s) => { gpt.o200k.clearMergeCache(); return gpt.o200k.encode(s); },
  llama3: (s) => llama3.encode(s, { bos: false, eos: false }),
};
const texts = {
  bible: fs.readFileSync(path.join(dir, 'bible.txt'), 'utf8'),
  unicode: fs.readFileSync(path.join(dir, 'unicode.txt'), 'utf8'),
};
console.log(`${'vocab'.padEnd(7)} ${'text'.padEnd(8)} ${'tokens'.padStart(10)} ${'MB/s'.padStart(9)}  (node ${process.version})`);
for (const [v, enc] of Object.entries(encoders)) {
  const lib = v === 'llama3' ? 'llama3-tokenizer-js' : 'gpt-tokenizer';
  for (const [tn, text] of Object.entries(texts)) {
    const bytes = Buffer.byteLength(text);
    const times = [];
    let n = 0;
    for (let r = 0; r < 3; r++) {
      const t0 = process.hrtime.bigint();
      n = enc(text).length;
      times.push(Number(process.hrtime.bigint() - t0) / 1e9);
    }
    times.sort((a, b) => a - b);
    console.log(`${v.padEnd(7)} ${tn.padEnd(8)} ${String(n).padStart(10)} ${(bytes / 1e6 / times[1]).toFixed(2).padStart(9)}  ${lib}`);
  }
}
