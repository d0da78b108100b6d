"""Draft-model speculation and the engine machinery shared by both proposers.

* greedy outputs identical with speculation on and off (several k, mixed batches with
  requests still prefilling, a small token budget that trims drafts);
* preemption (recompute and swap) and prefix caching with speculation: same greedy outputs,
  every block freed (the target pool and the draft proposer's own pool), block tables that
  never keep rejected tokens, and prefix-cache blocks that only hold final tokens;
* seeded sampled requests reproducible run to run;
* acceptance statistics consistent with the per-step counts;
* configuration errors (invalid ``speculative_config``, draft/target vocabulary mismatch).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import draft_runner, make_engine as conftest_make_engine, tiny_model, tiny_model_config
from kvflow.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from kvflow.engine.arg_utils import EngineArgs
from kvflow.core.block_pool import hash_block_tokens
from kvflow.core.kv_cache_manager import cdiv
from kvflow.engine.llm_engine import LLMEngine
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.draft_model import DraftModelProposer
from kvflow.core.spec_decode_stats import SpecDecodeStats
from kvflow.spec_decode.ngram import NgramProposer
from kvflow.attention.torch_backend import TORCH_BACKEND

CPU = torch.device("cpu")
VOCAB = 32
CONFIG = tiny_model_config(vocab_size=VOCAB)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads on a shared 2-core machine."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def draft_model(noise: float | None, seed: int = 7):
    """A draft for the tiny target (``tiny_model(CONFIG)``, seed 0): the target's weights
    plus Gaussian noise of std ``noise`` on every matrix, or (None) unrelated random weights."""
    if noise is None:
        return tiny_model(CONFIG, seed=seed)
    model = tiny_model(CONFIG, seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * noise)
    return model


def draft_proposer(model, cache: CacheConfig, k: int, max_model_len: int = 256, seed: int = 0,
                   backend=TORCH_BACKEND) -> DraftModelProposer:
    """A draft proposer over ``model`` with its runner made as the worker's builder makes it."""
    return DraftModelProposer(draft_runner(model, CONFIG, cache, seed, backend), CONFIG.vocab_size, cache, k, max_model_len)


def make_proposer(kind: str, k: int, max_model_len: int = 256, block_size: int = 4, num_blocks: int = 128,
                  noise: float | None = 0.02):
    if kind == "ngram":
        return NgramProposer(k, 1, 4, max_model_len)
    cache = CacheConfig(block_size, num_blocks, torch.float32, enable_prefix_caching=False)
    return draft_proposer(draft_model(noise), cache, k, max_model_len, seed=3)


def make_engine(proposer=None, num_blocks=128, block_size=4, max_num_batched_tokens=64, max_num_seqs=16,
                max_model_len=256, enable_prefix_caching=True, preemption_mode="recompute", num_cpu_blocks=0,
                seed=0) -> LLMEngine:
    return conftest_make_engine(
        model=tiny_model(CONFIG),
        model_config=CONFIG,
        cache_config=CacheConfig(block_size, num_blocks, torch.float32, enable_prefix_caching, num_cpu_blocks),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens, max_num_seqs, max_model_len, preemption_mode=preemption_mode
        ),
        tokenizer=None,
        device=CPU,
        seed=seed,
        proposer=proposer,
    )


def check_invariants(engine: LLMEngine) -> None:
    """Block accounting after a step (see ``Scheduler.update``):

    * a running request holds exactly cdiv(num_computed_tokens, block_size) blocks: the
      scheduler allocates only for the tokens it schedules, and after verification the
      blocks past the accepted tokens are trimmed, so no block holds only rejected drafts;
      its computed tokens are all final (num_computed_tokens < num_tokens);
    * every block's reference count equals the number of running block tables holding it;
    * a published prefix-cache block carries the hash of the request's final tokens;
    * the draft proposer keeps state only for running requests, with the same accounting in
      its own pool.
    """
    kv = engine.kv_cache_manager
    bs = kv.block_size
    running = engine.scheduler.running
    refs = Counter()
    for r in running:
        (table,) = r.block_ids  # one KV cache group
        assert len(table) == cdiv(r.num_computed_tokens, bs), r
        assert r.num_computed_tokens < r.num_tokens, r
        refs.update(table)
        assert r.num_published_blocks * bs <= r.num_computed_tokens
        parent = None
        for i in range(r.num_published_blocks):
            parent = hash_block_tokens(parent, r.all_token_ids[i * bs : (i + 1) * bs], kv.hash_extra)
            assert r.block_hashes[i] == parent, (r, i)
            published = kv.block_pool.blocks[table[i]].block_hash
            assert published is None or published == parent, (r, i)
    pool = kv.block_pool
    assert {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt} == dict(refs)
    assert pool.num_free_blocks == pool.num_blocks - len(refs)
    proposer = engine.proposer
    if isinstance(proposer, DraftModelProposer):
        shadows = proposer._seqs
        assert set(shadows) <= {r.request_id for r in running}
        draft_refs = Counter()
        for shadow in shadows.values():
            draft_table = shadow.block_ids[0] if shadow.block_ids else []
            assert len(draft_table) == cdiv(shadow.num_computed_tokens, bs)
            assert shadow.num_computed_tokens <= shadow.num_tokens
            draft_refs.update(draft_table)
        assert {b.block_id: b.ref_cnt for b in proposer.kv.block_pool.blocks if b.ref_cnt} == dict(draft_refs)


def run_schedule(engine: LLMEngine, arrivals, check: bool = True) -> dict[str, list[int]]:
    """Add request i at step arrivals[i][0] with prompt arrivals[i][1] and params
    arrivals[i][2]; run to the end, checking the invariants after each step; request id ->
    output tokens (of each sample: a list of lists when n > 1)."""
    done: dict[str, list] = {}
    step = 0
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(str(i), prompt, params)
        for out in engine.step():
            if out.finished:
                tokens = [o.token_ids for o in out.outputs]
                done[out.request_id] = tokens[0] if len(tokens) == 1 else tokens
        if check:
            check_invariants(engine)
        step += 1
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    if isinstance(engine.proposer, DraftModelProposer):
        assert engine.proposer.kv.num_free_blocks == engine.proposer.kv.num_total_blocks
        assert not engine.proposer._seqs
    return done


PROMPTS = [
    [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2],
    [7, 8, 9, 7, 8, 9, 7],
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 10, 11, 12],
    [30, 31],
    [3] * 9,
    [5, 9, 14, 2, 5, 9, 14],
]
ARRIVALS = [0, 0, 1, 3, 3, 6]


def greedy_arrivals(params=GREEDY):
    return [(t, p, params) for t, p in zip(ARRIVALS, PROMPTS)]


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs without speculation (large cache, no preemption)."""
    return run_schedule(make_engine(), greedy_arrivals())


# --------------------------------------------------------------------------- greedy equality
@pytest.mark.parametrize("k", [1, 2, 4, 6])
@pytest.mark.parametrize("budget", [5, 64])
@pytest.mark.parametrize("noise", [0.02, None], ids=["close-draft", "random-draft"])
def test_greedy_identical_with_draft_model(reference, k, budget, noise):
    engine = make_engine(make_proposer("draft", k, noise=noise), max_num_batched_tokens=budget)
    assert run_schedule(engine, greedy_arrivals()) == reference
    stats = engine.get_stats()
    assert stats["spec_num_draft_tokens"] > 0
    if noise is not None:
        assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_greedy_identical_with_output_dependent_processing(kind):
    """Penalties, min_tokens and logit_bias depend on the output so far: the target row of
    draft i must see drafts 1..i-1 as output (``DraftPositionView``), the draft model's too."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.4),
        SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=0.7, presence_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=24, logit_bias={5: 3.0, 9: -2.0}),
        SamplingParams(temperature=0.0, max_tokens=24, min_tokens=12, stop_token_ids=[8, 9, 20, 21]),
        SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=-1.0),  # encourages repeats
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=0.8),
    ]
    mixed = [(t, p, sp) for t, p, sp in zip(ARRIVALS, PROMPTS, params)]
    repeats = greedy_arrivals(SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=-1.0))
    for arrivals in (mixed, repeats):
        reference = run_schedule(make_engine(), arrivals)
        engine = make_engine(make_proposer(kind, 4), max_num_batched_tokens=16)
        assert run_schedule(engine, arrivals) == reference
        assert engine.get_stats()["spec_num_accepted_tokens"] > 0
    assert len(run_schedule(make_engine(), mixed)["3"]) >= 12


def test_identical_draft_accepts_everything(reference):
    """Draft == target: greedy drafts are all accepted (k + 1 tokens per verification), and
    sampled drafts almost all (p == q up to float noise between the two forwards)."""
    proposer = draft_proposer(tiny_model(CONFIG), CacheConfig(4, 128, torch.float32, False), 3)
    engine = make_engine(proposer)
    assert run_schedule(engine, greedy_arrivals()) == reference
    assert engine.get_stats()["spec_acceptance_rate"] == 1.0
    proposer = draft_proposer(tiny_model(CONFIG), CacheConfig(4, 128, torch.float32, False), 3)
    engine = make_engine(proposer)
    run_schedule(engine, greedy_arrivals(SamplingParams(temperature=1.0, max_tokens=24)))
    assert engine.get_stats()["spec_acceptance_rate"] > 0.99


def test_draft_on_the_triton_backend_accepts_everything(reference):
    """The draft runner takes the engine's attention backend (Triton kernels; in Triton's CPU
    interpreter without CUDA): an identical draft is still fully accepted, same outputs."""
    pytest.importorskip("triton")
    from kvflow.attention.triton_backend import TritonAttentionBackend

    proposer = draft_proposer(tiny_model(CONFIG), CacheConfig(4, 128, torch.float32, False), 3,
                              backend=TritonAttentionBackend())
    assert proposer.runner.attention_backend.name == "triton"
    engine = make_engine(proposer)
    assert run_schedule(engine, greedy_arrivals()) == reference
    assert engine.get_stats()["spec_acceptance_rate"] == 1.0


def test_draft_pool_exhaustion_shortens_drafts(reference):
    """A draft pool too small for every request's drafts: the requests it cannot hold get
    fewer (or no) drafts this step; outputs are unchanged and nothing leaks."""
    proposer = make_proposer("draft", 4, num_blocks=12)
    engine = make_engine(proposer)
    assert run_schedule(engine, greedy_arrivals()) == reference
    assert engine.get_stats()["spec_num_accepted_tokens"] > 0


# ---------------------------------------------------------------- preemption, prefix caching
@pytest.mark.parametrize("kind", ["ngram", "draft"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_keeps_greedy_outputs(reference, kind, mode, prefix_caching):
    # 13 blocks of 4 tokens for six requests of up to 45 tokens: preemption is certain.
    engine = make_engine(
        make_proposer(kind, 4), num_blocks=13, enable_prefix_caching=prefix_caching, preemption_mode=mode,
        num_cpu_blocks=8 if mode == "swap" else 0,
    )
    assert run_schedule(engine, greedy_arrivals()) == reference
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swapped_out"] > 0
    assert stats["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_prefix_cache_holds_only_final_tokens(kind):
    """After a speculative request finishes, a new request whose prompt is its prompt plus
    its output hits every full block (so they were published with the right contents) and
    continues exactly like one uninterrupted greedy run."""
    bs = 4
    prompt, first, more = PROMPTS[0], 22, 10
    full = run_schedule(make_engine(), [(0, prompt, SamplingParams(temperature=0.0, max_tokens=first + more))])["0"]
    engine = make_engine(make_proposer(kind, 4, noise=0.005))
    out = run_schedule(engine, [(0, prompt, SamplingParams(temperature=0.0, max_tokens=first))])["0"]
    assert out == full[:first]
    assert engine.get_stats()["spec_num_accepted_tokens"] >= 4
    hits_before = engine.get_stats()["prefix_cache_hits"]
    follow_prompt = prompt + out
    cont = run_schedule(engine, [(0, follow_prompt, SamplingParams(temperature=0.0, max_tokens=more))])["0"]
    # the first request computed all its tokens but the last output one
    assert engine.get_stats()["prefix_cache_hits"] - hits_before == (len(follow_prompt) - 1) // bs * bs
    assert cont == full[first:]


def test_prefix_cache_after_stop_inside_drafts():
    """A stop token among accepted drafts: the K/V computed past it is not published."""
    engine = make_engine(make_proposer("draft", 6, noise=0.0))  # draft == target: all accepted
    base = run_schedule(make_engine(), [(0, PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=30))])["0"]
    stop = base[9]
    params = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop])
    out = run_schedule(engine, [(0, PROMPTS[2], params)])["0"]
    assert out == base[: base.index(stop) + 1]
    # a follow-up sharing the prompt and output gets exactly the full blocks of final tokens
    hits_before = engine.get_stats()["prefix_cache_hits"]
    follow = PROMPTS[2] + out
    run_schedule(engine, [(0, follow, SamplingParams(temperature=0.0, max_tokens=2))])
    assert engine.get_stats()["prefix_cache_hits"] - hits_before == (len(follow) - 1) // 4 * 4


def test_abort_frees_draft_state():
    proposer = make_proposer("draft", 3)
    engine = make_engine(proposer)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    for _ in range(4):
        engine.step()
        check_invariants(engine)
    assert proposer._seqs
    for i in range(len(PROMPTS)):
        engine.abort_request(str(i))
    assert not engine.has_unfinished_requests()
    assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_total_blocks"]
    assert proposer.kv.num_free_blocks == proposer.kv.num_total_blocks and not proposer._seqs


# ------------------------------------------------------------------------- seeded sampling
def sampled_arrivals():
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=20),
        SamplingParams(temperature=1.0, seed=12, max_tokens=20, presence_penalty=0.5),
        SamplingParams(temperature=0.7, top_k=8, seed=13, max_tokens=20),
        SamplingParams(temperature=0.9, seed=14, max_tokens=20, n=2),
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=1.0, seed=15, max_tokens=20, min_p=0.05, repetition_penalty=1.2),
    ]
    return [(t, p, sp) for t, p, sp in zip(ARRIVALS, PROMPTS, params)]


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_seeded_sampling_reproducible(kind):
    runs = []
    for _ in range(2):
        engine = make_engine(make_proposer(kind, 3), max_num_batched_tokens=16)
        runs.append(run_schedule(engine, sampled_arrivals()))
    assert runs[0] == runs[1]
    assert engine.get_stats()["spec_num_accepted_tokens"] > 0
    # a different engine seed changes nothing for seeded requests (only the unseeded ones
    # draw from the engine generator; here the only unseeded request is greedy)
    engine = make_engine(make_proposer(kind, 3), max_num_batched_tokens=16, seed=99)
    assert run_schedule(engine, sampled_arrivals()) == runs[0]


def test_parallel_samples_draw_drafts_from_their_own_seeds():
    """Sample i of a seeded n > 1 request draws its drafts (as its tokens) from seed + i:
    its tokens are those of an n = 1 request seeded seed + i."""
    params = dict(temperature=1.0, max_tokens=20, ignore_eos=True)
    engine = make_engine(make_proposer("draft", 3))
    together = run_schedule(engine, [(0, PROMPTS[0], SamplingParams(seed=21, n=3, **params))])["0"]
    assert engine.get_stats()["spec_num_accepted_tokens"] > 0
    for i in range(3):
        alone = run_schedule(make_engine(make_proposer("draft", 3)), [(0, PROMPTS[0], SamplingParams(seed=21 + i, **params))])
        assert together[i] == alone["0"]


# ------------------------------------------------------------------------------- statistics
def test_spec_decode_stats_counts():
    stats = SpecDecodeStats(3)
    stats.record([(3, 3), (3, 0), (2, 1), (1, 1)])
    d = stats.as_dict()
    assert d["spec_num_draft_tokens"] == 9
    assert d["spec_num_accepted_tokens"] == 5
    assert d["spec_acceptance_rate"] == pytest.approx(5 / 9)
    assert d["spec_mean_accepted_length"] == pytest.approx(1 + 5 / 4)
    assert d["spec_acceptance_per_position"] == pytest.approx([3 / 4, 1 / 3, 1 / 2])
    assert SpecDecodeStats(0).as_dict() == {}
    empty = SpecDecodeStats(2).as_dict()
    assert empty["spec_acceptance_rate"] == 0.0 and empty["spec_acceptance_per_position"] == [0.0, 0.0]


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_engine_stats_consistent_with_steps(kind):
    k = 4
    engine = make_engine(make_proposer(kind, k), max_num_batched_tokens=9)
    verifications: list[tuple[int, int]] = []
    plain = 0
    execute = engine.model_runner.execute

    def counting_execute(out):
        nonlocal plain
        result = execute(out)
        for rid, tokens in result.sampled_token_ids.items():
            if rid in result.num_accepted:
                drafted, accepted = result.num_accepted[rid]
                assert drafted == len(out.scheduled_spec_tokens[rid]) and len(tokens) == accepted + 1
                verifications.append((drafted, accepted))
            else:
                plain += 1
        return result

    engine.model_runner.execute = counting_execute
    outputs = run_schedule(engine, greedy_arrivals())
    stats = engine.get_stats()
    drafted = sum(d for d, _ in verifications)
    accepted = sum(a for _, a in verifications)
    assert stats["spec_num_draft_tokens"] == drafted > 0
    assert stats["spec_num_accepted_tokens"] == accepted > 0
    assert stats["spec_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert stats["spec_mean_accepted_length"] == pytest.approx(1 + accepted / len(verifications))
    per_position = [
        sum(a > i for d, a in verifications if d > i) / max(1, sum(d > i for d, _ in verifications)) for i in range(k)
    ]
    assert stats["spec_acceptance_per_position"] == pytest.approx(per_position)
    # every output token came from a plain sample or a verification (no stop cut them here)
    assert sum(len(t) for t in outputs.values()) == plain + len(verifications) + accepted
    assert "spec_acceptance_rate" not in make_engine().get_stats()


# ------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize(
    "spec, field",
    [
        ({"num_speculative_tokens": 2}, "method"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": -3}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
         "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
        ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"}, "quantization"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": "x", "quantization": "int3"}, "quantization"),
    ],
)
def test_invalid_speculative_config(spec, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(spec)
    with pytest.raises(ValueError, match=field):  # checked before any model is loaded
        LLMEngine.from_engine_args(EngineArgs(model="/nonexistent/model", speculative_config=spec))


def test_speculative_config_must_be_a_dict():
    with pytest.raises(ValueError, match="speculative_config"):
        SpeculativeConfig.from_dict(["ngram", 4])


def test_valid_speculative_config():
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 2, 2)
    spec = SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 5, "model": "x"})
    assert spec.model == "x"


def _save_tiny_hf_llama(path, vocab_size: int, max_position_embeddings: int = 128) -> str:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(path))
    return str(path)


def test_vocab_mismatch_raises_at_load(tmp_path):
    target = _save_tiny_hf_llama(tmp_path / "target", 64)
    draft = _save_tiny_hf_llama(tmp_path / "draft", 80)
    args = EngineArgs(
        model=target, device="cpu", dtype="float32", num_kv_blocks=16,
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
    )
    with pytest.raises(ValueError, match="vocab"):
        LLMEngine.from_engine_args(args)


def test_draft_with_a_shorter_context_drafts_only_within_it(tmp_path):
    """A draft whose context (32 tokens) is shorter than the target's (128): requests get
    drafts while the draft's positions fit and plain decoding past them (no error), so greedy
    outputs are those without speculation."""
    from kvflow import SamplingParams

    target = _save_tiny_hf_llama(tmp_path / "target", 64)
    draft = _save_tiny_hf_llama(tmp_path / "draft", 64, max_position_embeddings=32)
    common = dict(model=target, device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, seed=0)
    plain = LLMEngine.from_engine_args(EngineArgs(**common))
    spec = LLMEngine.from_engine_args(EngineArgs(
        **common, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3}))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = []
    for engine in (plain, spec):
        for i, prompt in enumerate(([1, 2, 3, 4, 5], list(range(1, 41)))):  # crosses 32 tokens / starts past them
            engine.add_request(str(i), prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
        outs.append(done)
    assert outs[0] == outs[1]
    assert {reason for _, reason in outs[1].values()} == {"length"}
    assert spec.get_stats()["spec_num_draft_tokens"] > 0


def test_quantized_draft_model_keeps_greedy_outputs(tmp_path):
    """speculative_config.quantization quantizes the draft only; the float32 target still
    decides every token, so greedy outputs equal those without speculation."""
    from kvflow.quantization.int8 import Int8LinearMethod
    from kvflow import SamplingParams

    target = _save_tiny_hf_llama(tmp_path / "target", 64)
    draft = _save_tiny_hf_llama(tmp_path / "draft", 64)
    common = dict(model=target, device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, seed=0)
    plain = LLMEngine.from_engine_args(EngineArgs(**common))
    spec = LLMEngine.from_engine_args(EngineArgs(
        **common,
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "quantization": "int8"},
    ))
    draft_layer = spec.proposer.runner.model.layers[0]
    assert isinstance(draft_layer.mlp.down_proj.quant_method, Int8LinearMethod)
    from kvflow.layers.linear import UnquantizedLinearMethod

    assert isinstance(spec.model_runner.model.layers[0].mlp.down_proj.quant_method, UnquantizedLinearMethod)  # the target stays float
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for engine in (plain, spec):
        for i, prompt in enumerate(([1, 2, 3, 4, 5], [7, 7, 7], [9, 3, 12, 40, 41, 42, 5])):
            engine.add_request(str(i), prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        outs.append(done)
    assert outs[0] == outs[1]
    assert spec.get_stats()["spec_num_draft_tokens"] > 0


def test_disable_by_batch_size_skips_drafts_in_large_batches(tmp_path):
    """With disable_by_batch_size=2, steps with two running requests verify no drafts; once
    one request is left the draft model proposes again (after catching up), and greedy
    outputs stay those of plain decoding."""
    from kvflow import SamplingParams

    target = _save_tiny_hf_llama(tmp_path / "target", 64)
    common = dict(model=target, device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, seed=0)
    spec_cfg = {"method": "draft_model", "model": target, "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    engine = LLMEngine.from_engine_args(EngineArgs(**common, speculative_config=spec_cfg))
    plain = LLMEngine.from_engine_args(EngineArgs(**common))
    outs = []
    for eng in (engine, plain):
        eng.add_request("long", [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        eng.add_request("short", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        done, drafts_while_two, drafts_while_one = {}, 0, 0
        while eng.has_unfinished_requests():
            before = eng.get_stats().get("spec_num_draft_tokens", 0)
            running = len(eng.scheduler.running)
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            verified = eng.get_stats().get("spec_num_draft_tokens", 0) - before
            if running >= 2:
                drafts_while_two += verified
            else:
                drafts_while_one += verified
        outs.append(done)
        if eng is engine:
            assert drafts_while_two == 0
            assert drafts_while_one > 0
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_draft_cache_comes_out_of_the_kv_budget(tmp_path, kv_cache_dtype):
    """kv_cache_memory_bytes bounds the target's and the draft's caches together; both have
    the same number of blocks and the draft's follows kv_cache_dtype."""
    target = _save_tiny_hf_llama(tmp_path / "target", 64)
    budget = 256 * 1024
    common = dict(model=target, device="cpu", dtype="float32", kv_cache_memory_bytes=budget, block_size=4,
                  kv_cache_dtype=kv_cache_dtype)
    alone = LLMEngine.from_engine_args(EngineArgs(**common))
    spec = LLMEngine.from_engine_args(EngineArgs(
        **common, speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 2},
    ))

    def cache_bytes(cache_engine):
        return sum(t.numel() * t.element_size() for layer in cache_engine.kv_caches for t in layer)

    target_bytes = cache_bytes(spec.model_runner.cache_engine)
    draft_runner = spec.proposer.runner
    draft_bytes = cache_bytes(draft_runner.cache_engine)
    assert target_bytes + draft_bytes <= budget
    assert cache_bytes(alone.model_runner.cache_engine) <= budget
    # Same architecture for draft and target here: the budget is split in two.
    assert spec.cache_config.num_blocks == alone.cache_config.num_blocks // 2
    assert draft_runner.cache_engine.kv_caches[0][0].shape[0] == spec.cache_config.num_blocks
    assert draft_runner.cache_engine.kv_caches[0][0].dtype == spec.cache_config.dtype


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_draft_stops_where_its_masks_leave_no_token(temperature):
    """allowed_token_ids [4] and the bad word [4, 4]: the first draft is 4, after which no
    token is allowed. The draft model proposes [4] and stops there (a sampled row of all
    masked tokens made its multinomial raise a RuntimeError, failing the request as an
    internal error); the target then fails the request with the ValueError naming the fields."""
    from kvflow.request import Request
    from kvflow.sample.rejection_sampler import RejectionSampler

    cache = CacheConfig(4, 64, torch.float32, enable_prefix_caching=False)
    proposer = draft_proposer(draft_model(None), cache, k=3)
    request = Request("r", [1, 2, 3, 5, 6], SamplingParams(temperature=temperature, max_tokens=8, allowed_token_ids=[4]),
                      eos_token_id=None)
    request.bad_words_token_ids = [[4, 4]]
    proposer.propose([request])
    assert request.spec_token_ids == [4]
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="no token can be sampled: allowed_token_ids, bad_words"):
        RejectionSampler(torch.Generator().manual_seed(0))(request, request.spec_token_ids, logits)
    proposer.free("r")
