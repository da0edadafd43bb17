"""GGUF -> ONNX graphs against the independent numpy reference (support/numpy_reference.py)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from specd.ort_models import native_ops
from specd.ort_models.gguf_file import GGUFError
from specd.ort_models.graph_builder import BuildOptions
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ContextFull, ModelRunner

from numpy_reference import ReferenceModel
from tiny_gguf import write_corrupt_variants, write_tiny_gguf

K_DIMS = {"n_embd": 256, "n_ff": 512}
# gemma3 with sliding windows of 5 keys on every other layer (the tokens below cross the
# window's edge), their own rope base, and soft-capped logits
GEMMA3 = {"sliding_window": 5, "swa_pattern": 2, "rope_freq_base_swa": 10000.0,
          "final_softcap": 30.0}
CASES = [
    ("llama", "F32", {}), ("qwen2", "F32", {}), ("qwen3", "F32", {}),
    ("llama", "F16", {}), ("llama", "BF16", {}), ("llama", "Q8_0", {}),
    ("qwen2", "Q4_0", {}), ("llama", "Q4_1", {}), ("qwen2", "Q5_0", {}),
    ("qwen2", "Q4_K", K_DIMS), ("qwen3", "Q5_K", K_DIMS), ("llama", "Q6_K", K_DIMS),
    ("llama", "F32", {"n_head_kv": 4}),  # plain multi-head attention (group size 1)
    ("llama", "F32", {"rope_dim": 8}),  # partial rotary: 8 of 16 dims per head
    ("gemma3", "F32", GEMMA3), ("gemma3", "Q8_0", GEMMA3),
]
IDS = [f"{a}-{w}{'-mha' if kw.get('n_head_kv') == 4 else ''}"
       f"{'-rope8' if kw.get('rope_dim') else ''}" for a, w, kw in CASES]
TOKENS = [5, 17, 42, 100, 7, 3, 99, 12, 250, 31, 64, 128]


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def case(request, tiny_model_factory):
    arch, wt, kw = request.param
    return tiny_model_factory(arch=arch, weight_type=wt, **kw), wt


def _all_rows(r: ModelRunner, toks: list[int], pos: int = 0) -> np.ndarray:
    return r.forward(0, toks, pos, list(range(len(toks))))


def test_logits_match_reference_exactly_in_fp32(case) -> None:
    """accuracy_level 1 computes in fp32: the repacking itself must be lossless."""
    path, _ = case
    r = ModelRunner(load_or_build(path, BuildOptions(accuracy_level=1)), n_ctx=256)
    want = ReferenceModel(path).forward(TOKENS)  # [S, vocab] float64
    got = _all_rows(r, TOKENS)
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 2e-5, rel


def test_logits_match_reference_at_accuracy_level_4(case) -> None:
    """int8 activations (as llama.cpp on CPU): small error, same greedy where clear."""
    path, wt = case
    r = ModelRunner(load_or_build(path), n_ctx=256)
    ref = ReferenceModel(path)
    want = ref.forward(TOKENS)
    got = _all_rows(r, TOKENS)
    rel = np.abs(got - want).max() / np.abs(want).max()
    dense = wt in ("F32", "F16", "BF16")
    # the tiny models amplify activation rounding through sharp attention; 10% bound
    assert rel < (2e-5 if dense else 0.1), rel
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.5
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()


def test_greedy_32_steps_matches_reference(tiny_model_factory) -> None:
    for arch, kw in (("llama", {}), ("qwen2", {}), ("qwen3", {}), ("gemma3", GEMMA3)):
        path = tiny_model_factory(arch=arch, weight_type="F32", **kw)
        r = ModelRunner(load_or_build(path), n_ctx=256)
        want = ReferenceModel(path).greedy([1, 2, 3, 4], 32)
        toks, pos = [1, 2, 3, 4], 0
        got = []
        logits = r.prefill(0, toks)
        pos = len(toks)
        for _ in range(32):
            t = int(np.argmax(logits))
            got.append(t)
            logits = r.forward(0, [t], pos)[0]
            pos += 1
        assert got == want[-32:]


def test_multi_token_block_equals_single_steps_bitwise(case) -> None:
    path, _ = case
    built = load_or_build(path)
    singles_r = ModelRunner(built, n_ctx=512)
    singles = np.stack([singles_r.forward(0, [t], i)[0] for i, t in enumerate(TOKENS)])
    block_r = ModelRunner(built, n_ctx=512)
    block_r.forward(0, TOKENS[:4], 0)
    block = block_r.forward(0, TOKENS[4:], 4, list(range(len(TOKENS) - 4)))
    assert np.array_equal(block, singles[4:])


def test_rollback_then_rerun_equals_fresh_run(tiny_model_factory) -> None:
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0")
    built = load_or_build(path)
    fresh = ModelRunner(built, n_ctx=512)
    want = _all_rows(fresh, TOKENS)
    r = ModelRunner(built, n_ctx=512)
    r.forward(0, TOKENS[:6] + [300, 301, 302, 303], 0)  # 4 wrong tokens after 6 good ones
    got = r.forward(0, TOKENS[6:], 6, list(range(len(TOKENS) - 6)))  # roll back to 6
    assert np.array_equal(got, want[6:])


def test_sequences_are_independent(tiny_model_factory) -> None:
    path = tiny_model_factory(arch="llama", weight_type="Q8_0")
    r = ModelRunner(load_or_build(path), n_ctx=256, n_seq=2)
    a = r.forward(0, TOKENS, 0)
    r.forward(1, [9, 9, 9, 9], 0)
    again = ModelRunner(load_or_build(path), n_ctx=256).forward(0, TOKENS, 0)
    assert np.array_equal(a, again)


def test_bucket_crossing_prefill_matches_reference(tiny_model_factory) -> None:
    path = tiny_model_factory(arch="qwen2", weight_type="F32", context_length=1024)
    rng = np.random.default_rng(1)
    toks = rng.integers(3, 340, size=300).tolist()
    r = ModelRunner(load_or_build(path), n_ctx=512)
    got = r.prefill(0, toks)
    want = ReferenceModel(path).forward(toks)[-1]
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-5


@pytest.mark.parametrize("arch, kw", [("qwen2", {}), ("llama", {"n_head_kv": 4}),
                                      ("qwen3", {}), ("llama", {"rope_dim": 8}),
                                      ("gemma3", GEMMA3)])
def test_fused_attention_matches_reference(tiny_model_factory, arch, kw) -> None:
    """attention="fused" (GroupQueryAttention, drafts): chunked prefill across a bucket
    boundary, a multi-token block and a rolled-back block, all as the reference says."""
    path = tiny_model_factory(arch=arch, weight_type="F32", context_length=1024, **kw)
    toks = np.random.default_rng(2).integers(3, 340, size=300).tolist()
    want = ReferenceModel(path).forward(toks)  # [300, vocab]
    built = load_or_build(path, BuildOptions(accuracy_level=1, attention="fused"))
    assert built.folder != load_or_build(path, BuildOptions(accuracy_level=1)).folder
    r = ModelRunner(built, n_ctx=512)
    r.forward(0, toks[:296] + [7, 7, 7], 0)  # 3 wrong tokens after 296, also past 256
    got = {
        "prefill": r.prefill(0, toks[:290])[None],
        "block": r.forward(0, toks[290:295], 290, list(range(5))),  # rolls back to 290
        "rolled back": r.forward(0, toks[292:300], 292, list(range(8))),
    }
    for name, rows in {"prefill": [289], "block": range(290, 295),
                       "rolled back": range(292, 300)}.items():
        w = want[list(rows)]
        assert np.abs(got[name] - w).max() / np.abs(w).max() < 2e-5, name


def test_unknown_attention_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        BuildOptions(attention="flash")


def test_hidden_state_outputs(tiny_model_factory) -> None:
    path = tiny_model_factory(arch="llama", weight_type="F32")
    built = load_or_build(path, BuildOptions(hidden_layers=(0, 1)))
    r = ModelRunner(built, n_ctx=256)
    assert r.feature_layers == (0, 1)
    logits, hidden = r.forward_with_features(0, TOKENS, 0)
    assert sorted(hidden) == [0, 1]
    assert hidden[0].shape == (len(TOKENS), 64)
    assert np.array_equal(logits, ModelRunner(load_or_build(path), n_ctx=256)
                          .forward(0, TOKENS, 0))
    _, only = r.forward_with_features(0, TOKENS, 0, layers=[1])
    assert sorted(only) == [1] and np.array_equal(only[1], hidden[1])
    with pytest.raises(ValueError, match="not \\[2\\]"):
        r.forward_with_features(0, TOKENS, 0, layers=[2])


def test_prefill_features_are_the_forward_features(tiny_model_factory) -> None:
    """A prompt evaluated in bucket-sized chunks gives each token's hidden states as one
    call over the whole prompt does (the rows are computed alike, whatever the call)."""
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", context_length=512)
    built = load_or_build(path, BuildOptions(hidden_layers=(1,)))
    prompt = [(i * 37) % 300 + 3 for i in range(300)]
    chunked = ModelRunner(built, n_ctx=512)
    last, features = chunked.prefill_with_features(0, prompt, 0, chunk=128)
    whole = ModelRunner(built, n_ctx=512)
    logits, want = whole.forward_with_features(0, prompt, 0, [len(prompt) - 1])
    assert features[1].shape == (len(prompt), 64)
    np.testing.assert_allclose(features[1], want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(last, logits[0], rtol=1e-5, atol=1e-5)


def test_runners_can_share_one_kv_cache(tiny_model_factory) -> None:
    """Two sessions bound to one KVCache see each other's rows: what one evaluates, the
    other attends to (a drafter's injection and block graphs share a draft cache so)."""
    path = tiny_model_factory(arch="qwen2", weight_type="F32")
    built = load_or_build(path)
    alone = ModelRunner(built, n_ctx=256)
    want = alone.forward(0, TOKENS, 0, [len(TOKENS) - 1])
    first = ModelRunner(built, n_ctx=256)
    second = ModelRunner(built, n_ctx=256, kv=first.kv)
    assert second.kv is first.kv and second.n_seq == first.n_seq == 1
    first.forward(0, TOKENS[:-1], 0)  # writes rows 0..n-2 of the shared cache
    got = second.forward(0, TOKENS[-1:], len(TOKENS) - 1)  # attends to them
    np.testing.assert_array_equal(got, want)
    assert second.add_sequence() == 1 and first.kv.n_seq == 2
    other = load_or_build(tiny_model_factory(arch="llama", weight_type="F32", n_layer=3))
    with pytest.raises(ValueError, match="shared KV cache"):
        ModelRunner(other, n_ctx=256, kv=first.kv)


def _calls(r: ModelRunner, *, hidden: bool = False) -> list[np.ndarray]:
    """A prompt, single steps, a rolled-back block, a block longer than 4, long calls up
    to the end of the context and single steps there (fewer filler rows fit): every
    logits (and hidden) array they return."""
    out = []
    fill = [(i * 37) % 300 + 3 for i in range(512)]  # long calls: never padded
    for toks, pos, rows in ((TOKENS[:4], 0, [0, 1, 2, 3]), ([TOKENS[4]], 4, None),
                            ([TOKENS[5], 300, 301], 5, [0, 1, 2]),  # 2 wrong, rolled back
                            (TOKENS[6:8], 6, [0, 1]), (TOKENS[8:], 8, [1, 3]),
                            ([TOKENS[0]], 12, None), (fill[13:254], 13, None),
                            ([7, 8], 254, [0, 1]), (fill[256:510], 256, None),
                            ([9], 510, None), ([10], 511, None)):
        if hidden:
            logits, features = r.forward_with_features(0, toks, pos, rows)
            out += [logits, *features.values()]
        else:
            out.append(r.forward(0, toks, pos, rows))
    return out


def test_fixed_row_block_changes_no_result(tiny_model_factory) -> None:
    """row_block (the fixed call shape used on CUDA) runs short calls with filler rows
    after the real ones and drops their results; their cache writes land after the real
    tokens and are overwritten. On the CPU, where no kernel of a Q8_0 model depends on
    the number of rows, nothing may change, hidden states included."""
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", context_length=512)
    built = load_or_build(path, BuildOptions(hidden_layers=(0,)))
    plain = ModelRunner(built, n_ctx=512)
    padded = ModelRunner(built, n_ctx=512, row_block=4)
    assert plain.row_block == 1  # the CPU's default
    want, got = _calls(plain, hidden=True), _calls(padded, hidden=True)
    assert [a.shape for a in got] == [a.shape for a in want]
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_invariant_block_limit_keeps_rows_exact(tiny_model_factory) -> None:
    """One attention bucket per block; with a row block at most row_block tokens, each at
    a position whose single step runs the same number of rows (the buffers end at the
    rotary table, 512 here: the last row_block - 1 positions get single steps only)."""
    built = load_or_build(tiny_model_factory(arch="llama", context_length=512))
    plain, padded = ModelRunner(built, n_ctx=512), ModelRunner(built, n_ctx=512, row_block=4)
    assert [plain.invariant_block_limit(p) for p in (0, 250, 255, 256, 509)] == [256, 6, 1,
                                                                                  256, 3]
    assert [padded.invariant_block_limit(p) for p in (0, 250, 254, 255, 505, 506, 508, 511)
            ] == [4, 4, 2, 1, 4, 3, 1, 1]
    short = ModelRunner(built, n_ctx=256, row_block=4)  # room past n_ctx for the filler
    assert short.kv_bytes == 259 * built.hparams.kv_bytes_per_token(built.options.kv_bytes)
    two = ModelRunner(built, n_ctx=512, min_rows=2)  # blocks of any size; singles of 2 rows
    assert [two.invariant_block_limit(p) for p in (0, 250, 509, 510, 511)] == [256, 6, 2, 1,
                                                                                1]
    assert [two.call_rows(p, n) for p, n in ((0, 1), (0, 2), (0, 5), (510, 1), (511, 1))
            ] == [2, 2, 5, 2, 1]
    for pos in range(two.n_ctx):  # a block's rows: singles of the same kernels (>= 2 rows)
        limit = two.invariant_block_limit(pos)
        assert limit == 1 or all(two.call_rows(q, 1) == 2 for q in range(pos, pos + limit))
    for r in (padded, short):
        for pos in range(r.n_ctx):
            limit = r.invariant_block_limit(pos)
            assert 1 <= limit <= r.n_ctx - pos
            for n in range(2, limit + 1):  # every block's shape is its rows' single steps'
                assert all(r.call_rows(pos, n) == r.call_rows(q, 1)
                           for q in range(pos, pos + n))


def test_single_steps_of_two_rows_equal_block_rows(tiny_model_factory) -> None:
    """min_rows=2 (the default where ORT computes a one-row 4-bit product differently from
    the same row in a larger call): a single step runs a filler row and its logits equal
    that row of a block, bit for bit, on any CPU."""
    path = tiny_model_factory(arch="qwen2", weight_type="Q4_0", context_length=512)
    built = load_or_build(path)
    singles_r = ModelRunner(built, n_ctx=512, min_rows=2)
    singles = np.stack([singles_r.forward(0, [t], i)[0] for i, t in enumerate(TOKENS)])
    block_r = ModelRunner(built, n_ctx=512, min_rows=2)
    block_r.forward(0, TOKENS[:3], 0)
    assert np.array_equal(_all_rows(block_r, TOKENS[3:], 3), singles[3:])


def test_a_prefills_last_row_equals_its_single_step_with_two_rows(tiny_model_factory
                                                                   ) -> None:
    """min_rows=2 holds for the output product too: a prompt's last logits are the same
    from a fresh prefill (one logits row of a long call) and from a cached prefix (the
    last token re-evaluated alone, as a request reusing a slot's cache does)."""
    path = tiny_model_factory(arch="qwen2", weight_type="Q4_0", context_length=512)
    built = load_or_build(path)
    fresh = ModelRunner(built, n_ctx=512, min_rows=2).prefill(0, TOKENS)
    cached = ModelRunner(built, n_ctx=512, min_rows=2)
    cached.prefill(0, TOKENS[:-1])
    assert np.array_equal(cached.forward(0, TOKENS[-1:], len(TOKENS) - 1)[0], fresh)


def test_a_trained_context_off_the_bucket_grid_ends_the_context(tiny_model_factory) -> None:
    """n_ctx never passes the rotary table (600 positions here, not a multiple of 256)."""
    path = tiny_model_factory(arch="llama", weight_type="F32", context_length=600)
    r = ModelRunner(load_or_build(path), n_ctx=4096)
    assert r.n_ctx == 600 and r.invariant_block_limit(590) == 10
    toks = [(i * 7) % 300 + 3 for i in range(600)]
    r.prefill(0, toks[:599])
    got = r.forward(0, toks[599:], 599)[0]
    want = ReferenceModel(path).forward(toks)[-1]
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-5
    with pytest.raises(ContextFull, match="context of 600"):
        r.forward(0, [1], 600)


def test_context_full_is_a_clear_error(tiny_model_factory) -> None:
    r = ModelRunner(load_or_build(tiny_model_factory(arch="llama")), n_ctx=256)
    with pytest.raises(ContextFull, match="context of 256"):
        r.forward(0, [1] * 10, 250)


def test_second_load_does_not_rebuild(tiny_model_factory) -> None:
    path = tiny_model_factory(arch="qwen3", weight_type="Q8_0", seed=7)
    first = load_or_build(path)
    second = load_or_build(path)
    assert first.folder == second.folder and not second.built_now


def test_a_build_removes_graphs_of_other_builder_versions(tiny_model_factory, tmp_path,
                                                          monkeypatch) -> None:
    from specd.ort_models.model_cache import BUILDER_VERSION

    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))  # a cache of its own
    path = tiny_model_factory(arch="llama", weight_type="F16", seed=8)
    kept = load_or_build(path)  # this version, other options: kept
    sha = kept.gguf_sha256[:24]
    stale = kept.folder.parent / f"{sha}-b{int(BUILDER_VERSION) - 1}-hnone_p0_a4"
    other_file = kept.folder.parent / f"{'0' * 24}-b1-hnone_p0_a4"
    for folder in (stale, other_file):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.onnx").write_bytes(b"old")
    stale_lock = stale.with_name(f"{stale.name}.lock")
    stale_lock.write_bytes(b"")
    fresh = load_or_build(path, BuildOptions(hidden_layers=(0,)))
    assert fresh.built_now
    assert not stale.exists() and not stale_lock.exists()
    assert kept.folder.is_dir() and other_file.is_dir()  # other GGUFs are not touched


_LOAD_AND_RUN = """
import json, sys
from specd.ort_models.model_cache import load_or_build
from specd.ort_models.runner import ModelRunner
built = load_or_build(sys.argv[1])
logits = ModelRunner(built, n_ctx=256, threads=1).prefill(0, [1, 2, 3])
print(json.dumps({"built_now": built.built_now, "finite": bool(abs(logits).max() < 1e30)}))
"""


def test_two_processes_loading_one_new_graph_build_it_once(tiny_model_factory, tmp_path,
                                                           monkeypatch) -> None:
    """Started together on an empty cache: one builds, the other waits for it and loads
    the complete graph (before, both built and the second removed the folder the first
    was loading: NO_SUCHFILE)."""
    import json
    import os
    import subprocess
    import sys

    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=12)
    env = {**os.environ, "SPECD_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD_AND_RUN, str(path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["built_now"] for r in results) == [False, True]
    assert all(r["finite"] for r in results)


def test_leftovers_of_killed_builds_and_damaged_graphs(tiny_model_factory, tmp_path,
                                                       monkeypatch) -> None:
    """A build killed mid-way (SIGTERM, SIGKILL) leaves its scratch folder: the next build
    of that graph removes it. A damaged graph (a file cut short) is rebuilt, not trusted."""
    import subprocess
    import sys

    import psutil

    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=13)
    first = load_or_build(path)
    dead_pid = 4_000_000
    assert not psutil.pid_exists(dead_pid)
    dead = first.folder.with_name(f"{first.folder.name}.tmp{dead_pid}")
    dead.mkdir()
    (dead / "weights.bin").write_bytes(b"half")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live = first.folder.with_name(f"{first.folder.name}.tmp{other.pid}")  # a build running
    live.mkdir()  # where no lock keeps it out (Windows): left alone
    weights = first.folder / "weights.bin"
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    try:
        again = load_or_build(path)
    finally:
        other.kill()
        other.wait()
    assert again.built_now and not dead.exists() and live.exists()
    assert np.isfinite(ModelRunner(again, n_ctx=256, threads=1).prefill(0, [1, 2])).all()
    assert not load_or_build(path).built_now


def test_a_graph_ort_cannot_load_names_its_folder(tiny_model_factory, tmp_path,
                                                  monkeypatch) -> None:
    from specd.ort_models.runner import GraphLoadError

    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    built = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=14))
    (built.folder / "model.onnx").write_bytes(b"\0" * 16)
    with pytest.raises(GraphLoadError, match="ONNX Runtime cannot load this graph") as info:
        ModelRunner(built, n_ctx=256, threads=1)
    assert str(built.folder) in str(info.value) and "rebuilt" in str(info.value)


def test_an_unwritable_hash_memo_does_not_stop_a_load(tiny_model_factory, tmp_path,
                                                      monkeypatch) -> None:
    """The content-hash memo is only a memo: a full (here: unwritable) cache still loads."""
    from specd.ort_models.gguf_file import content_hash

    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    (tmp_path / "hashes.json").mkdir()  # os.replace onto it fails, as on a full disk
    path = tiny_model_factory(arch="qwen2", weight_type="Q8_0", seed=15)
    assert len(content_hash(path)) == 64
    assert not list(tmp_path.glob("hashes.*.tmp"))


@pytest.mark.parametrize("variant, message", [
    ("truncated", "truncated|not a readable GGUF"),
    ("garbage", "not a readable GGUF"),
    ("empty", "not a readable GGUF"),
    ("unknown_arch", "unsupported architecture 'mamba9'"),
    ("unsupported_type", "blk.0.attn_q.weight.*IQ2_XXS"),
    ("unsupported_q2_k", "blk.0.ffn_up.weight.*Q2_K"),
    ("missing_tensor", "missing tensor 'blk.1.ffn_down.weight'"),
])
def test_bad_files_give_one_clear_error(tmp_path, variant, message) -> None:
    paths = write_corrupt_variants(tmp_path)
    with pytest.raises(GGUFError, match=message) as info:
        load_or_build(paths[variant])
    assert "\n" not in str(info.value)
    assert paths[variant].name in str(info.value)  # which file (a target's or a draft's)


def _patch_uint32(src, dst, key: str, value: int):
    """A copy of GGUF `src` whose uint32 metadata `key` holds `value` (same length)."""
    blob = bytearray(src.read_bytes())
    raw = key.encode()
    at = blob.find(struct.pack("<Q", len(raw)) + raw)
    assert at >= 0, key
    at += 8 + len(raw)
    assert struct.unpack_from("<I", blob, at)[0] == 4  # GGUF type id of uint32
    struct.pack_into("<I", blob, at + 4, value)
    dst.write_bytes(bytes(blob))
    return dst


@pytest.mark.parametrize("key, value, message", [
    ("llama.attention.head_count", 0, r"llama.attention.head_count must be an integer >= 1"),
    ("llama.attention.head_count_kv", 0, r"head_count_kv must be an integer >= 1, got 0"),
    ("llama.embedding_length", 96, r"token_embd.weight is \[\d+, 64\], but the metadata"),
    ("llama.feed_forward_length", 64, r"ffn_gate.weight is \[128, 64\].*implies \[64, 64\]"),
    ("llama.block_count", 5, "block_count is 5 but the file has no layer 4"),
    ("llama.block_count", 0, "block_count must be an integer >= 1"),
    ("llama.rope.dimension_count", 7, "rope.dimension_count is 7; it must be even"),
    ("llama.rope.dimension_count", 1000, "rope.dimension_count is 1000;.*head dimension 16"),
])
def test_metadata_disagreeing_with_the_tensors_is_named(tmp_path, key, value,
                                                         message) -> None:
    good = write_tiny_gguf(tmp_path / "good.gguf", arch="llama", weight_type="Q8_0")
    bad = _patch_uint32(good, tmp_path / "bad.gguf", key, value)
    with pytest.raises(GGUFError, match=message) as info:
        load_or_build(bad)
    assert "\n" not in str(info.value) and "bad.gguf" in str(info.value)


def _patch_tensor_dim(src, dst, name: str, axis: int, value: int):
    """A copy of GGUF `src` whose tensor `name` claims `value` along GGUF axis `axis`."""
    blob = bytearray(src.read_bytes())
    raw = name.encode()
    at = blob.find(struct.pack("<Q", len(raw)) + raw)
    assert at >= 0, name
    at += 8 + len(raw)
    assert axis < struct.unpack_from("<I", blob, at)[0]  # n_dims
    struct.pack_into("<Q", blob, at + 4 + 8 * axis, value)
    dst.write_bytes(bytes(blob))
    return dst


def test_a_later_layer_disagreeing_with_the_metadata_is_named(tmp_path) -> None:
    """Every layer is checked, not only the first (a wrong shape in layer 1 failed at the
    first token, inside ONNX Runtime)."""
    good = write_tiny_gguf(tmp_path / "good.gguf", arch="llama", weight_type="Q8_0")
    bad = _patch_tensor_dim(good, tmp_path / "bad.gguf", "blk.1.ffn_up.weight", 1, 64)
    with pytest.raises(GGUFError, match=r"blk.1.ffn_up.weight is \[64, 64\]") as info:
        load_or_build(bad)
    assert "bad.gguf" in str(info.value)


def test_impossible_tensor_sizes_and_duplicates_are_named(tmp_path) -> None:
    good = write_tiny_gguf(tmp_path / "good.gguf", arch="llama", weight_type="Q8_0")
    huge = _patch_tensor_dim(good, tmp_path / "huge.gguf", "blk.0.ffn_up.weight", 1, 2**62)
    with pytest.raises(GGUFError, match="huge.gguf: truncated file: tensor 'blk.0.ffn_up"):
        load_or_build(huge)  # 64 x 2**62 values wrapped around to 0 bytes before
    entry = struct.pack("<Q", 19) + b"blk.0.attn_k.weight"  # renamed to attn_q: twice
    blob = good.read_bytes()
    assert blob.count(entry) == 1
    dup = tmp_path / "dup.gguf"
    dup.write_bytes(blob.replace(entry, struct.pack("<Q", 19) + b"blk.0.attn_q.weight"))
    with pytest.raises(GGUFError, match="dup.gguf: tensor 'blk.0.attn_q.weight' appears twice"):
        load_or_build(dup)


def _requantized_reference(path, kind: str) -> ReferenceModel:
    """The reference with every multiplied matrix replaced by its 4-bit re-quantization
    (the embedding lookup keeps the GGUF's exact rows)."""
    from specd.ort_models.quant import requant_block_size, requantize_q4

    def requantized(w: np.ndarray) -> np.ndarray:
        bs = requant_block_size(kind, w.shape[1])
        return requantize_q4(w.astype(np.float32), bs).dequantize().astype(np.float64)

    ref = ReferenceModel(path)
    for name, w in list(ref.weights.items()):
        if w.ndim == 2 and name != "token_embd.weight":
            ref.weights[name] = requantized(w)
    ref.output_weight = requantized(ref.output_weight)
    return ref


@pytest.mark.parametrize("arch, wt, kind", [("qwen2", "Q5_0", "q4"), ("llama", "Q4_K", "q4"),
                                            ("llama", "F16", "q4"), ("llama", "Q4_K", "q4g128"),
                                            ("qwen2", "Q5_0", "q4g128")])
def test_requantized_draft_graph_matches_its_reference(tiny_model_factory, arch, wt,
                                                       kind) -> None:
    """requant="q4"/"q4g128": per-block zero points, fused matrices and a tied output that
    must not share the exact embedding's initializers, all computed as the reference says."""
    path = tiny_model_factory(arch=arch, weight_type=wt, **(K_DIMS if wt == "Q4_K" else {}))
    built = load_or_build(path, BuildOptions(accuracy_level=1, requant=kind))
    exact = load_or_build(path, BuildOptions(accuracy_level=1))
    assert built.folder != exact.folder
    assert built.weights_bytes < exact.weights_bytes or wt != "Q5_0"
    got = _all_rows(ModelRunner(built, n_ctx=256), TOKENS)
    want = _requantized_reference(path, kind).forward(TOKENS)
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 2e-5, rel
    # and it is a different model from the exact one (the test above is not vacuous)
    plain = ReferenceModel(path).forward(TOKENS)
    assert np.abs(plain - want).max() / np.abs(want).max() > 1e-4


_HEADS = [("qwen2", "Q8_0", {}, {}), ("llama", "F32", {}, {}),  # MatMulNBits, dense (tied)
          ("qwen2", "Q5_0", {}, {"requant": "q4"})]  # re-quantized, per-block zero points
if native_ops.library() is not None:  # GgufMatMul rows: an exact Q4_K head, a q4k draft's
    _HEADS += [("qwen2", "Q4_K", K_DIMS, {"kernels": "gguf"}),
               ("llama", "Q8_0", {}, {"kernels": "gguf", "requant": "q4k"})]


@pytest.mark.parametrize("arch, wt, dims, opts", _HEADS)
def test_vocab_rows_gives_the_first_ids_logits(tiny_model_factory, arch, wt, dims,
                                               opts) -> None:
    """A draft's head cut to the first ids: those logits, bit for bit (output channels
    are independent), and nothing else; a separate graph in the cache."""
    path = tiny_model_factory(arch=arch, weight_type=wt, **dims)
    full = load_or_build(path, BuildOptions(**opts))
    cut = load_or_build(path, BuildOptions(**opts, vocab_rows=100))
    assert cut.folder != full.folder
    assert cut.read_bytes_per_token < full.read_bytes_per_token
    want = _all_rows(ModelRunner(full, n_ctx=256), TOKENS)  # [S, vocab]
    got = _all_rows(ModelRunner(cut, n_ctx=256), TOKENS)  # [S, 100]
    assert got.shape == (len(TOKENS), 100)
    np.testing.assert_array_equal(got, want[:, :100])
    n_vocab = full.hparams.n_vocab  # past the vocabulary: all of it, and the same graph
    assert BuildOptions(vocab_rows=n_vocab + 5).logits_width(n_vocab) == n_vocab
    whole = load_or_build(path, BuildOptions(**opts, vocab_rows=n_vocab))
    assert whole.folder == full.folder and not whole.built_now
    assert whole.options.vocab_rows == 0


def test_negative_vocab_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="vocab_rows must be >= 0"):
        BuildOptions(vocab_rows=-1)


def test_unknown_requant_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown requant 'q3'"):
        BuildOptions(requant="q3")


def test_bytes_read_per_token_leave_out_only_row_lookups(tiny_model_factory) -> None:
    """A decode step reads every matrix but the embedding table, unless the output
    matrix is that table (tied)."""
    from specd.ort_models.gguf_file import GGUFFile

    kw = {"arch": "qwen2", "weight_type": "Q8_0", "seed": 3}
    untied = load_or_build(tiny_model_factory(**kw, tie_embeddings=False))
    tied = load_or_build(tiny_model_factory(**kw, tie_embeddings=True))
    v, e = untied.hparams.n_vocab, untied.hparams.n_embd
    table = v * e * 34 // 32  # Q8_0: a byte per weight and an fp16 scale per 32
    # both read one [V, E] output matrix (tied: the table itself) and the same blocks
    assert untied.read_bytes_per_token == tied.read_bytes_per_token > table
    # the untied file also holds the table (initializers are aligned to 4 KiB)
    skipped = untied.weights_bytes - untied.read_bytes_per_token
    assert table <= skipped - (tied.weights_bytes - tied.read_bytes_per_token) <= table * 2
    # tied: only the rotary tables (looked up at the positions) are left out
    import onnx

    from specd.ort_models.model_cache import initializer_sizes

    size = initializer_sizes(onnx.load(str(tied.model_path), load_external_data=False))
    assert sum(size.values()) - tied.read_bytes_per_token == size["rope.cos"] + size["rope.sin"]
    g_untied = GGUFFile(untied.gguf_path)
    embd = g_untied.tensor("token_embd.weight").data.nbytes
    total = sum(t.data.nbytes for t in g_untied.tensors.values())
    assert g_untied.bytes_read_per_token() == total - embd
    g_tied = GGUFFile(tied.gguf_path)
    assert g_tied.bytes_read_per_token() == sum(t.data.nbytes for t in g_tied.tensors.values())


def test_runtime_choice_and_session_providers(monkeypatch) -> None:
    import onnxruntime as ort

    from specd.ort_models.providers import choose_runtime, session_providers

    assert choose_runtime("cpu").provider == "CPUExecutionProvider"
    monkeypatch.setenv("SPECD_DEVICE", "cpu")  # what "auto" means where it is set
    assert choose_runtime("auto").reason == "CPU requested"
    if "CUDAExecutionProvider" not in ort.get_available_providers():  # the CPU package
        monkeypatch.delenv("SPECD_DEVICE")
        auto = choose_runtime("auto")
        assert (auto.provider, auto.device) == ("CPUExecutionProvider", "cpu")
        assert "CUDA EP not available" in auto.reason
        with pytest.raises(RuntimeError, match="CUDA EP not available"):
            choose_runtime("cuda:0")
        monkeypatch.setenv("SPECD_DEVICE", "cuda")
        with pytest.raises(RuntimeError, match="CUDA EP not available"):
            choose_runtime("auto")
    assert session_providers("cpu") == ["CPUExecutionProvider"]
    assert session_providers("cuda:0") == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert session_providers("cuda:1") == [("CUDAExecutionProvider", {"device_id": 1}),
                                           "CPUExecutionProvider"]


def test_a_cuda_build_without_usable_cuda_falls_back_or_says_why(monkeypatch) -> None:
    """onnxruntime-gpu lists its CUDA EP even where the CUDA libraries (or the device) are
    missing: "auto" must then take the CPU and say why, and an explicit cuda device must
    be a clear error, not a crash at the first session."""
    import onnxruntime as ort

    from specd.ort_models import providers

    if providers.cuda_problem(0) is None:
        pytest.skip("CUDA works here")
    monkeypatch.delenv("SPECD_DEVICE", raising=False)
    monkeypatch.setattr(ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    auto = providers.choose_runtime("auto")
    assert (auto.provider, auto.device) == ("CPUExecutionProvider", "cpu")
    assert auto.reason.startswith("CUDA EP not usable (")
    with pytest.raises(providers.DeviceUnavailable, match="cuda:0 cannot be used: "):
        providers.choose_runtime("cuda")


@pytest.mark.skipif(native_ops.library() is None, reason="specd's kernels did not compile")
def test_a_graph_with_specds_cpu_kernels_runs_on_the_cpu(tiny_model_factory,
                                                        monkeypatch) -> None:
    from specd.ort_models.providers import RuntimeChoice

    built = load_or_build(tiny_model_factory(arch="qwen2", weight_type="Q4_K", **K_DIMS),
                          BuildOptions(kernels="gguf", attention="native", kv_dtype="f16"))
    monkeypatch.setenv("SPECD_DEVICE", "cuda")  # "auto" would be CUDA (or an error)
    assert ModelRunner(built, n_ctx=256).runtime.device == "cpu"
    gpu = RuntimeChoice("1.0", "onnxruntime-gpu", "CUDAExecutionProvider", "cuda:0", "test")
    with pytest.raises(ValueError, match="specd's CPU kernels and cannot run on cuda:0"):
        ModelRunner(built, n_ctx=256, runtime=gpu)
