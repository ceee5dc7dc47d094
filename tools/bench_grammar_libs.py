# Side-by-side grammar libraries for structured output: xgrammar, llguidance,
# outlines-core. Compile times (median of 3 fresh compiles, caches off), and a
# 40-step random-logits decode of 16 matchers on the nested schema: mask fill
# (sequential, and the library's batched/threaded call), numpy mask apply,
# and advancing by one token (medians per step, ms, for all 16 rows).
# Needs a venv with the three libraries and tokenizers (xgrammar pulls torch):
#   python3 -m venv /tmp/sovenv && /tmp/sovenv/bin/pip install xgrammar llguidance outlines_core tokenizers numpy
#   /tmp/sovenv/bin/python tools/bench_grammar_libs.py --train /tmp/bpe        # trains 32k and 152k byte-level BPEs
#   /tmp/sovenv/bin/python tools/bench_grammar_libs.py /tmp/bpe/bpe32k /tmp/bpe/bpe152k
SIMPLE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "status": {"enum": ["active", "inactive", "banned"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "maxItems": 4,
        },
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
            "required": ["name"],
            "additionalProperties": False,
        },
        "value": {"anyOf": [{"type": "number"}, {"type": "string"}, {"type": "null"}]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "status", "tags", "owner", "value"],
    "additionalProperties": False,
}
_types = [
    {"type": "string"},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
    {"enum": ["a", "b", "c"]},
    {"type": "array", "items": {"type": "integer"}},
]
WIDE = {
    "type": "object",
    "properties": {f"field_{i:02d}": _types[i % len(_types)] for i in range(30)},
    "required": [f"field_{i:02d}" for i in range(0, 30, 2)],
    "additionalProperties": False,
}
REGEX = r"(\+\d{1,3} )?\(\d{3}\) \d{3}-\d{4}|[a-z]{3,10}@[a-z]{2,8}\.(com|org|net)"
CHOICE = ["positive", "negative", "neutral", "mixed feelings"]
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")" | "-" factor
NUMBER: /[0-9]+(\.[0-9]+)?/
"""

import tokenizers


def _bytes_decoder():
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BD = _bytes_decoder()


def load(path):
    tok = tokenizers.Tokenizer.from_file(path + "/tokenizer.json")
    V = tok.get_vocab_size(with_added_tokens=True)
    vocab = tok.get_vocab(with_added_tokens=True)
    pieces = [None] * V
    for s, i in vocab.items():
        pieces[i] = s
    eos = tok.token_to_id("<|im_end|>")
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    raw = [
        bytes(BD[c] for c in p) if i not in specials else p.encode()
        for i, p in enumerate(pieces)
    ]
    return tok, V, pieces, raw, eos, specials


import json
import os
import statistics
import sys
import time

import numpy as np


def train(out_dir):
    import pathlib

    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    roots = [
        "/usr/lib/python3.11",
        sys.prefix + "/lib/python3.11/site-packages",
        "/usr/share/doc",
        "/usr/share/common-licenses",
    ]

    def files():
        for r in roots:
            for p in pathlib.Path(r).rglob("*"):
                if p.suffix in (".py", ".txt", ".md", ".rst", "") and p.is_file():
                    yield p

    def it(limit):
        total = 0
        for p in files():
            try:
                t = p.read_text(encoding="utf-8")
            except Exception:
                continue
            total += len(t)
            yield t
            if total > limit:
                return

    for size, limit in [(32000, 20e6), (152000, 150e6)]:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tr = trainers.BpeTrainer(
            vocab_size=size,
            min_frequency=2,
            show_progress=False,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(it(limit), trainer=tr)
        d = pathlib.Path(out_dir) / f"bpe{size // 1000}k"
        d.mkdir(parents=True, exist_ok=True)
        tok.save(str(d / "tokenizer.json"))
        print(d, tok.get_vocab_size(), flush=True)


def run(path, libs):
    STEPS = int(os.environ.get("STEPS", "40"))
    B = 16
    tok, V, pieces, raw, eos, specials = load(path)
    print(f"# vocab {path}: V={V}", flush=True)

    def med(f, n=3):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            r = f()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3, r

    def apply_mask(logits, bitmask):
        # bitmask (B, ceil(V/32)) int32, bit j of word w = token 32w+j; branchless
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[
            :, : logits.shape[1]
        ]
        pen = allowed.astype(np.int32)
        pen -= 1
        pen &= np.int32(-8388608)
        logits += pen.view(np.float32)

    choice_re = "(" + "|".join(CHOICE) + ")"
    results = {}

    def drive(name, fill_batch, advance_batch, matchers_row_done, bitmask):
        """STEPS steps of B constrained random-logit sampling; returns medians (ms)."""
        rng = np.random.default_rng(0)
        fills, applies, advs = [], [], []
        for step in range(STEPS):
            logits = rng.standard_normal((B, V), dtype=np.float32)
            t0 = time.perf_counter()
            fill_batch(bitmask)
            t1 = time.perf_counter()
            apply_mask(logits, bitmask)
            t2 = time.perf_counter()
            toks = logits.argmax(axis=1).tolist()
            t3 = time.perf_counter()
            advance_batch(toks)
            t4 = time.perf_counter()
            fills.append(t1 - t0)
            applies.append(t2 - t1)
            advs.append(t4 - t3)
        f = lambda xs: round(statistics.median(xs) * 1e3, 3)
        p90 = lambda xs: round(sorted(xs)[int(0.9 * len(xs))] * 1e3, 3)
        return dict(
            fill=f(fills), fill_p90=p90(fills), apply=f(applies), advance=f(advs)
        )

    DOC = {
        "id": 12345,
        "status": "inactive",
        "tags": ["alpha", "beta gamma", "x"],
        "owner": {"name": "Ada Lovelace", "email": "ada@example.org"},
        "value": 3.25,
        "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-22", "qty": 10}],
    }
    doc_ids = tok.encode(json.dumps(DOC), add_special_tokens=False).ids + [eos]
    OFFSET = max(1, (len(doc_ids) - 1) // (2 * B))  # rows spread over the first half

    def forced(make, fill_batch, consume):
        """Teacher-forced through a valid document: matcher i runs OFFSET*i
        tokens ahead, so the 16 rows sit at different places (keys, numbers,
        enums, strings). Median/p90 of the fill per step, ms."""
        ms = [make() for _ in range(B)]
        pos = [OFFSET * i for i in range(B)]
        for m, p in zip(ms, pos):
            for t in doc_ids[:p]:
                consume(m, t)
        bm = np.full((B, (V + 31) // 32), -1, dtype=np.int32)
        fills = []
        while max(pos) < len(doc_ids) - 1:
            t0 = time.perf_counter()
            fill_batch(ms, bm)
            fills.append(time.perf_counter() - t0)
            for i, m in enumerate(ms):
                consume(m, doc_ids[pos[i]])
                pos[i] += 1
        return dict(
            fill=round(statistics.median(fills) * 1e3, 3),
            fill_p90=round(sorted(fills)[int(0.9 * len(fills))] * 1e3, 3),
            steps=len(fills),
        )

    # ---------------- xgrammar
    if "xgr" in libs:
        import xgrammar as xgr

        t0 = time.perf_counter()
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
        info = xgr.TokenizerInfo(
            pieces,
            meta["vocab_type"],
            vocab_size=V,
            stop_token_ids=[eos],
            add_prefix_space=meta["add_prefix_space"],
        )
        tvocab = (time.perf_counter() - t0) * 1e3
        comp = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        r = {"vocab_ms": round(tvocab, 1), "vocab_type": str(meta["vocab_type"])}
        for k, f in [
            (
                "simple",
                lambda: comp.compile_json_schema(
                    json.dumps(SIMPLE), any_whitespace=True
                ),
            ),
            ("nested", lambda: comp.compile_json_schema(json.dumps(NESTED))),
            ("wide30", lambda: comp.compile_json_schema(json.dumps(WIDE))),
            ("regex", lambda: comp.compile_regex(REGEX)),
            ("choice", lambda: comp.compile_regex(choice_re)),
            ("lark", lambda: comp.compile_lark(LARK)),
            ("json_object", lambda: comp.compile_builtin_json_grammar()),
        ]:
            r[k], _ = med(f)

        def first_xgr():
            m1 = xgr.GrammarMatcher(comp.compile_json_schema(json.dumps(NESTED)))
            b1 = np.full((1, (V + 31) // 32), -1, dtype=np.int32)
            m1.fill_next_token_bitmask(b1, 0)

        r["first_mask_nested"], _ = med(first_xgr)
        cg = comp.compile_json_schema(json.dumps(NESTED))
        ms = [xgr.GrammarMatcher(cg) for _ in range(B)]
        bm = np.full((B, (V + 31) // 32), -1, dtype=np.int32)
        bgm = xgr.BatchGrammarMatcher(max_threads=2)

        def fill_seq(bm):
            for i, m in enumerate(ms):
                m.fill_next_token_bitmask(bm, i)

        def adv(toks):
            for m, t in zip(ms, toks):
                if not m.is_terminated():
                    assert m.accept_token(t)

        r["step_seq"] = drive("xgr", fill_seq, adv, None, bm)
        ms = [xgr.GrammarMatcher(cg) for _ in range(B)]
        r["step_batch"] = drive(
            "xgr", lambda bm: bgm.batch_fill_next_token_bitmask(ms, bm), adv, None, bm
        )
        r["forced"] = forced(
            lambda: xgr.GrammarMatcher(cg),
            lambda ms, bm: [m.fill_next_token_bitmask(bm, i) for i, m in enumerate(ms)],
            lambda m, t: m.accept_token(t),
        )
        results["xgrammar"] = r
        print("xgrammar", json.dumps(r), flush=True)

    # ---------------- llguidance
    if "llg" in libs:
        import llguidance as llg
        import llguidance.numpy as llnp

        t0 = time.perf_counter()
        lt = llg.LLTokenizer(tok.to_str(), n_vocab=V, eos_token=eos)
        r = {"vocab_ms": round((time.perf_counter() - t0) * 1e3, 1)}

        def mk(g):
            m = llg.LLMatcher(lt, g, log_level=0)
            assert not m.is_error(), m.get_error()
            return m

        G = llg.LLMatcher
        for k, g in [
            ("simple", G.grammar_from_json_schema(SIMPLE)),
            ("nested", G.grammar_from_json_schema(NESTED)),
            ("wide30", G.grammar_from_json_schema(WIDE)),
            ("regex", G.grammar_from_regex(REGEX)),
            ("choice", G.grammar_from_regex(choice_re)),
            ("lark", G.grammar_from_lark(LARK)),
            ("json_object", G.grammar_from_json_schema({"type": "object"})),
        ]:
            r[k], _ = med(lambda: mk(g))
        g = G.grammar_from_json_schema(NESTED)

        def first_llg():
            b1 = llnp.allocate_token_bitmask(1, V)
            llnp.fill_next_token_bitmask(mk(g), b1, 0)

        r["first_mask_nested"], _ = med(first_llg)
        ms = [mk(g) for _ in range(B)]
        bm = llnp.allocate_token_bitmask(B, V)
        ex = llg.LLExecutor(num_threads=2)

        def fill_seq(bm):
            for i, m in enumerate(ms):
                llnp.fill_next_token_bitmask(m, bm, i)

        def adv(toks):
            for m, t in zip(ms, toks):
                if not m.is_stopped():
                    assert m.consume_token(t), m.get_error()

        r["step_seq"] = drive("llg", fill_seq, adv, None, bm)
        ms = [mk(g) for _ in range(B)]
        r["step_batch"] = drive(
            "llg",
            lambda bm: llnp.fill_next_token_bitmask_par(
                ex, [(m, i) for i, m in enumerate(ms)], bm
            ),
            adv,
            None,
            bm,
        )
        r["forced"] = forced(
            lambda: mk(g),
            lambda ms, bm: [
                llnp.fill_next_token_bitmask(m, bm, i) for i, m in enumerate(ms)
            ],
            lambda m, t: m.consume_token(t),
        )
        results["llguidance"] = r
        print("llguidance", json.dumps(r), flush=True)

    # ---------------- outlines_core
    if "oc" in libs:
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema

        t0 = time.perf_counter()
        m = {}
        for i, b in enumerate(raw):
            if i == eos or i in specials:
                continue
            m.setdefault(b, []).append(i)
        voc = oc.Vocabulary(eos, m)
        r = {"vocab_ms": round((time.perf_counter() - t0) * 1e3, 1)}
        n = int(os.environ.get("OC_N", "1"))
        for k, f in [
            (
                "simple",
                lambda: oc.Index(build_regex_from_schema(json.dumps(SIMPLE)), voc),
            ),
            (
                "nested",
                lambda: oc.Index(build_regex_from_schema(json.dumps(NESTED)), voc),
            ),
            (
                "wide30",
                lambda: oc.Index(build_regex_from_schema(json.dumps(WIDE)), voc),
            ),
            ("regex", lambda: oc.Index(REGEX, voc)),
            ("choice", lambda: oc.Index(choice_re, voc)),
        ]:
            try:
                r[k], _ = med(f, n)
            except Exception as e:
                r[k] = f"error: {str(e)[:80]}"
            print("  oc", k, r[k], flush=True)
        r["lark"] = "unsupported"
        r["first_mask_nested"] = r[
            "nested"
        ]  # the Index is the compile; masks are lookups
        idx = oc.Index(build_regex_from_schema(json.dumps(NESTED)), voc)
        gs = [oc.Guide(idx) for _ in range(B)]
        bm = np.full((B, (V + 31) // 32), -1, dtype=np.int32)

        def fill_seq(bm):
            for i, g in enumerate(gs):
                row = bm[i]
                g.write_mask_into(row.ctypes.data, row.size, 4)

        def adv(toks):
            for g, t in zip(gs, toks):
                if not g.is_finished():
                    g.advance(t, return_tokens=False)

        r["step_seq"] = drive("oc", fill_seq, adv, None, bm)

        def oc_fill(ms, bm):
            for i, gd in enumerate(ms):
                row = bm[i]
                gd.write_mask_into(row.ctypes.data, row.size, 4)

        r["forced"] = forced(
            lambda: oc.Guide(idx),
            oc_fill,
            lambda gd, t: gd.advance(t, return_tokens=False),
        )
        results["outlines_core"] = r
        print("outlines_core", json.dumps(r), flush=True)

    # mask application alone (library independent)
    bm = np.random.default_rng(1).integers(
        -(2**31), 2**31 - 1, size=(B, (V + 31) // 32), dtype=np.int32
    )
    lg = np.zeros((B, V), np.float32)
    t, _ = med(lambda: apply_mask(lg, bm), 20)
    print("apply_mask_only_ms", round(t, 3))


if __name__ == "__main__":
    if sys.argv[1] == "--train":
        train(sys.argv[2])
    else:
        libs = os.environ.get("LIBS", "xgr,llg,oc").split(",")
        for p in sys.argv[1:]:
            run(p, libs)
