"""The runner's persistent batch (kvflow/worker/input_batch.py) and the vectorized decode
grouping of the torch backend."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvflow.attention.torch_backend import _split_by_context_reference, split_by_context
from kvflow.sampling_params import SamplingParams
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.model_runner import CachedRequestState


def _state(rid: str, tokens: list[int], computed: int, **params) -> CachedRequestState:
    return CachedRequestState(rid, tokens[:3], list(tokens), SamplingParams(**params), None, [], computed)


def _naive(tokens, tables, computed, n, bs):
    """The per-request form the batch replaces: positions and slots of one chunk."""
    pos = torch.arange(computed, computed + n)
    return tokens[computed : computed + n], pos.tolist(), (torch.tensor(tables)[pos // bs] * bs + pos % bs).tolist()


def test_rows_stay_dense_and_match_the_per_request_form():
    """Random adds, appends, block replacements and removals (rows condensed): every
    request's token ids, positions and slots of a random chunk equal the per-request
    computation from its own lists; the batch grows past its first allocation."""
    rng = random.Random(0)
    bs = 4
    batch = InputBatch(num_kv_cache_groups=2, max_num_reqs=2, max_model_len=8, block_size=bs)
    held: dict[str, tuple[list[int], list[list[int]], int]] = {}
    for step in range(300):
        op = rng.random()
        if op < 0.3 or not held:
            rid = f"r{step}"
            tokens = [rng.randrange(1000) for _ in range(rng.randint(3, 30))]
            tables = [[rng.randrange(500) for _ in range(-(-len(tokens) // bs) + 1)] for _ in range(2)]
            computed = rng.randrange(len(tokens))
            batch.add_request(_state(rid, tokens, computed), tuple(tables))
            held[rid] = (tokens, tables, computed)
        elif op < 0.5:
            rid = rng.choice(sorted(held))
            assert batch.remove_request(rid)
            del held[rid]
        else:
            rid = rng.choice(sorted(held))
            tokens, tables, computed = held[rid]
            row = batch.req_id_to_index[rid]
            new = [rng.randrange(1000) for _ in range(rng.randint(1, 3))]
            tokens.extend(new)
            if rng.random() < 0.5:
                batch.append_tokens(row, new)
            else:
                batch.append_tokens_batch(np.array([row]), [new])
            for g in range(2):
                if rng.random() < 0.2:
                    tables[g] = [rng.randrange(500) for _ in range(-(-len(tokens) // bs))]
                    batch.set_block_ids(row, g, tables[g], replace=True)
                else:
                    extra = [rng.randrange(500) for _ in range(max(0, -(-len(tokens) // bs) - len(tables[g])))]
                    tables[g].extend(extra)
                    batch.set_block_ids(row, g, extra, replace=False)
            computed = len(tokens) - 1
            batch.num_computed_tokens[row] = computed
            held[rid] = (tokens, tables, computed)
        assert batch.num_reqs == len(held) and sorted(batch.req_ids) == sorted(held)
        assert all(batch.req_id_to_index[r] == i for i, r in enumerate(batch.req_ids))
    assert batch.token_ids.shape[0] > 2 and batch.token_ids.shape[1] > 8  # grew
    rids = sorted(held)
    rows = np.array([batch.req_id_to_index[r] for r in rids])
    q = np.array([rng.randint(1, len(held[r][0]) - held[r][2]) for r in rids])
    token_rows, positions, starts = batch.token_positions(rows, q)
    ids = batch.token_ids[token_rows, positions]
    for g in range(2):
        slots = batch.slot_mapping(g, token_rows, positions)
        table, lens = batch.padded_block_tables(g, rows)
        for i, r in enumerate(rids):
            tokens, tables, computed = held[r]
            want_ids, want_pos, want_slots = _naive(tokens, tables[g], computed, int(q[i]), bs)
            s, e = starts[i], starts[i + 1]
            assert ids[s:e].tolist() == want_ids and positions[s:e].tolist() == want_pos
            assert slots[s:e].tolist() == want_slots
            assert table[i, : len(tables[g])].tolist() == tables[g] and int(lens[i]) == len(tables[g])
            assert not table[i, len(tables[g]) :].any()  # padding: block 0


def test_batched_token_appends_equal_the_per_row_ones():
    """``append_tokens_batch`` over several rows (a decode step's one token each, or 0-3
    tokens each) and over one row leaves the same tokens and counts as ``append_tokens``
    row by row, growing the token axis past its first allocation."""
    rng = random.Random(1)
    batches = [InputBatch(max_num_reqs=8, max_model_len=8, block_size=4) for _ in range(2)]
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(3, 6))] for _ in range(8)]
    for b in batches:
        for i, prompt in enumerate(prompts):
            b.add_request(_state(f"r{i}", prompt, 0), ([0, 1],))
    for step in range(40):
        rows = np.array(rng.sample(range(8), rng.choice([1, 3, 8])), dtype=np.int64)
        one_each = rng.random() < 0.5
        new = [[rng.randrange(1000) for _ in range(1 if one_each else rng.randint(0, 3))] for _ in rows]
        batches[0].append_tokens_batch(rows, new)
        for row, tokens in zip(rows.tolist(), new):
            batches[1].append_tokens(row, tokens)
        assert np.array_equal(batches[0].num_tokens, batches[1].num_tokens)
        width = int(batches[0].num_tokens.max())
        assert np.array_equal(batches[0].token_ids[:8, :width], batches[1].token_ids[:8, :width])
    assert batches[0].token_ids.shape[1] > 8


def test_sampling_parameters_move_with_their_row():
    batch = InputBatch(max_num_reqs=4)
    batch.add_request(_state("a", [1, 2, 3, 4], 3, temperature=0.5, top_k=7, top_p=0.9, min_p=0.1), ([0],))
    batch.add_request(_state("b", [1, 2, 3, 4], 3, temperature=0), ([1],))
    batch.add_request(_state("c", [1, 2, 3, 4], 3, temperature=1.0, top_k=2**70), ([2],))
    batch.remove_request("a")  # c moves to row 0
    row = batch.req_id_to_index["c"]
    assert row == 0 and batch.states[0].request_id == "c" and batch.block_ids(0) == [2]
    assert batch.temperature[row] == 1.0 and batch.top_k[row] == 2**62 and batch.top_p[row] == 1.0
    assert batch.temperature[batch.req_id_to_index["b"]] == 0.0
    # 1e300 is a valid temperature; float32 makes it inf (and -inf masked logits / inf NaN): capped
    batch.add_request(_state("hot", [1, 2, 3, 4], 3, temperature=1e300), ([3],))
    assert batch.temperature[batch.req_id_to_index["hot"]] == np.finfo(np.float32).max
    with pytest.raises(ValueError, match="already"):
        batch.add_request(_state("b", [1, 2, 3], 0), ([1],))
    with pytest.raises(ValueError, match="block tables"):
        batch.add_request(_state("d", [1, 2, 3], 0), ([1], [2]))
    assert not batch.remove_request("a")


def test_logits_processing_flags_and_seeded_rows_move_with_their_row():
    """Only rows flagged ``needs_logits_processing`` go through the logits processors and
    ``num_generator_reqs`` says whether any row has its own generator (the runner skips
    both paths otherwise): each processor's parameter flags its row, the flag moves with
    the row when another leaves, and the count follows adds and removals."""
    batch = InputBatch(max_num_reqs=2)
    flagged = {"pen": dict(repetition_penalty=1.2), "freq": dict(frequency_penalty=0.5),
               "pres": dict(presence_penalty=0.5), "bias": dict(logit_bias={5: 1.0}), "min": dict(min_tokens=2)}
    batch.add_request(_state("plain", [1, 2, 3, 4], 3, temperature=0), ([0],))
    for rid, params in flagged.items():
        batch.add_request(_state(rid, [1, 2, 3, 4], 3, **params), ([1],))
    bad = _state("bad", [1, 2, 3, 4], 3)
    bad.bad_words_token_ids = [[7]]
    batch.add_request(bad, ([2],))
    seeded = _state("seeded", [1, 2, 3, 4], 3, temperature=1.0, seed=3)
    seeded.generator = torch.Generator().manual_seed(3)
    batch.add_request(seeded, ([3],))
    flags = {rid: bool(batch.needs_logits_processing[row]) for rid, row in batch.req_id_to_index.items()}
    assert flags == {"plain": False, "seeded": False, **{rid: True for rid in (*flagged, "bad")}}
    assert batch.num_generator_reqs == 1
    batch.remove_request("pen")  # the last row (seeded, unflagged) moves into pen's (flagged)
    assert batch.req_id_to_index["seeded"] == 1 and not batch.needs_logits_processing[1]
    batch.remove_request("plain")  # the last row now (bad, flagged) moves into plain's
    assert batch.req_id_to_index["bad"] == 0 and batch.needs_logits_processing[0]
    batch.remove_request("seeded")
    assert batch.num_generator_reqs == 0


def test_vectorized_decode_grouping_equals_the_dynamic_program():
    rng = random.Random(1)
    for _ in range(500):
        blocks = [rng.randint(1, rng.choice([1, 3, 20, 200])) for _ in range(rng.randint(0, 40))]
        overhead = rng.choice([0, 1, 16, 512, 10**9])
        assert split_by_context(blocks, 16, overhead) == _split_by_context_reference(blocks, 16, overhead)
