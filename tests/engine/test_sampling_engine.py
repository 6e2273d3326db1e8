"""Sampling and stopping through the whole engine: seeded reproducibility whatever the batch, EOS, stop token
ids, max_tokens, and stop strings with streamed text (with a real byte-level BPE tokenizer).

The reference for each check is the engine itself on a seeded request (temperature 1.0 gives varied tokens even
from a random model): the same seed must give the same tokens alone, beside random neighbours, with another
adapter mix, in chunked prefill, and through preemption; stopping rules are then checked against that sequence.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from factories import make_peft_adapter, make_tiny_model
from loraplex.engine import LLM, EngineCore, SamplingParams
from loraplex.engine.request import RequestOutput

VOCAB = 512
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {"r4": dict(r=4, target_modules=ALL), "r16": dict(r=16, target_modules=("q_proj", "v_proj", "down_proj")),
            "r64": dict(r=64, target_modules=("k_proj", "o_proj", "up_proj"))}
N = 24  # tokens of the reference sequences


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: intra-op threads only cost synchronisation
    yield
    torch.set_num_threads(n)


def save_byte_level_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """Train a byte-level BPE of exactly vocab_size ids (<pad>, <s>, </s> = 0, 1, 2, then the 256 bytes, then
    merges) on made-up words, and save it beside the model as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "be", "do", "fu", "ga", "hi", "ju", "pe", "ze"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    corpus = [" ".join(rng.choice(words) for _ in range(20)) + rng.choice(".!?,") for _ in range(500)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == vocab_size
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sampling")


@pytest.fixture(scope="module")
def model_dir(root) -> Path:
    d = make_tiny_model(root / "model", "llama", vocab_size=VOCAB)
    save_byte_level_tokenizer(d, VOCAB)
    return d


@pytest.fixture(scope="module")
def adapter_dirs(root, model_dir) -> dict[str, Path]:
    return {name: make_peft_adapter(model_dir, root / name, lora_alpha=2 * spec["r"], **spec)
            for name, spec in ADAPTERS.items()}


def make_llm(model_dir: Path, adapter_dirs: dict[str, Path], **kw) -> LLM:
    kw.setdefault("pool_bytes", 16 << 20)
    llm = LLM(str(model_dir), kernels="torch", max_lora_rank=64, **kw)
    for name, d in adapter_dirs.items():
        llm.load_adapter(name, d)
    return llm


@pytest.fixture(scope="module")
def llm(model_dir, adapter_dirs) -> LLM:
    return make_llm(model_dir, adapter_dirs)


def rand_prompt(rng: random.Random, lo: int = 2, hi: int = 40) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))]


def neighbour_params(rng: random.Random) -> SamplingParams:
    kw: dict = dict(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.5)
    kind = rng.random()
    if kind < 0.3:
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = rng.uniform(0.3, 2.0)
        kw["top_k"] = rng.choice([0, 0, rng.randint(1, 100)])
        kw["top_p"] = rng.choice([1.0, rng.uniform(0.1, 1.0)])
        if kind < 0.7:
            kw["seed"] = rng.randrange(2**63)
    return SamplingParams(**kw)


def seeded(seed: int, max_tokens: int = N, **kw) -> SamplingParams:
    kw.setdefault("temperature", 1.0)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, seed=seed, **kw)


# --- seeded reproducibility -------------------------------------------------------------------------------------


def test_same_seed_same_tokens_whatever_the_batch(model_dir, adapter_dirs, llm):
    rng = random.Random()
    names = [None, *ADAPTERS]
    # Targets: seeded requests with assorted filters and adapters; two of them share one seed and prompt.
    targets = []
    for i in range(6):
        params = seeded(rng.randrange(2**63), temperature=rng.choice([0.7, 1.0, 1.3]),
                        top_k=rng.choice([0, 40]), top_p=rng.choice([1.0, 0.9]))
        targets.append((rand_prompt(rng), params, rng.choice(names)))
    targets.append(targets[0])

    def run(engine_llm: LLM, neighbours: int, adapter_pool: list) -> list[list[int]]:
        batch = [(rand_prompt(rng), neighbour_params(rng), rng.choice(adapter_pool)) for _ in range(neighbours)]
        slots = sorted(rng.sample(range(len(batch) + len(targets)), len(targets)))
        order = rng.sample(range(len(targets)), len(targets))  # targets in a shuffled order, at random slots
        for slot, t in zip(slots, order):
            batch.insert(slot, targets[t])
        outs = engine_llm.generate([b[0] for b in batch], [b[1] for b in batch], adapters=[b[2] for b in batch])
        got = [None] * len(targets)
        for slot, t in zip(slots, order):
            assert outs[slot].finish_reason == "length"
            got[t] = outs[slot].token_ids
        return got

    alone = [llm.generate([p], params, adapters=[a])[0].token_ids for p, params, a in targets]
    assert all(len(t) == N for t in alone)
    assert alone[0] == alone[-1]
    assert len({tuple(t) for t in alone[:-1]}) == len(alone) - 1, "different seeds should give different tokens"

    assert run(llm, 20, names) == alone
    assert run(llm, 30, [None, "r64"]) == alone  # another adapter mix
    chunked = make_llm(model_dir, adapter_dirs, max_num_batched_tokens=7)  # prompts in chunks beside decodes
    assert run(chunked, 12, names[1:]) == alone
    # A pool far too small for the batch: requests are preempted and recomputed, their generators carry on.
    geo = llm.engine.pager.geometry
    table = llm.engine.adapters
    adapter_pages = sum(geo.adapter_num_pages(table.host(table.resolve(n))) for n in ADAPTERS)
    preemptions = 0
    smalls = []
    for kv_requests in (4, 2, 1):  # from small to barely one request's growth beside every adapter
        small = make_llm(model_dir, adapter_dirs,
                         pool_bytes=(adapter_pages + kv_requests * geo.kv_pages_for_tokens(40 + N)) * geo.page_bytes)
        assert run(small, 16, names) == alone
        preemptions += small.engine.stats().num_preemptions
        smalls.append(small)
    # Whether the random batches above preempt depends on their random lengths. This one always does:
    # prompts of exactly one block fill the pool at admission (more of them than it has blocks), and the
    # first decode step needs a fresh block for every running request.
    block = llm.engine.config.block_size
    squeezed = make_llm(model_dir, adapter_dirs, pool_bytes=(adapter_pages + 2 * geo.kv_pages_for_tokens(40 + N))
                        * geo.page_bytes)
    n_req = squeezed.engine.pager.geometry.num_pages // geo.kv_pages_for_tokens(block) + 4
    prompts = [[rng.randrange(3, VOCAB) for _ in range(block)] for _ in range(n_req)]
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    want = [llm.generate([p], greedy)[0].token_ids for p in prompts]
    assert [o.token_ids for o in squeezed.generate(prompts, greedy)] == want
    preemptions += squeezed.engine.stats().num_preemptions
    assert squeezed.engine.stats().num_preemptions > 0
    smalls.append(squeezed)
    for e in (llm, chunked, *smalls):
        e.engine.pager.check_integrity()
        assert e.engine.stats().kv_pages == 0


def test_seed_prefix_and_max_tokens(llm):
    """max_tokens cuts a seeded sequence (the same one) with finish_reason 'length'."""
    rng = random.Random()
    prompt, seed, adapter = rand_prompt(rng), rng.randrange(2**63), rng.choice([None, *ADAPTERS])
    full = llm.generate([prompt], seeded(seed), adapters=[adapter])[0].token_ids
    ms = rng.sample(range(1, N), 5)
    outs = llm.generate([prompt] * len(ms), [seeded(seed, m) for m in ms], adapters=[adapter] * len(ms))
    for m, out in zip(ms, outs):
        assert out.finish_reason == "length" and out.token_ids == full[:m]
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    g_full = llm.generate([prompt], greedy, adapters=[adapter])[0].token_ids
    outs = llm.generate([prompt] * len(ms), [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                                             for m in ms], adapters=[adapter] * len(ms))
    for m, out in zip(ms, outs):
        assert out.finish_reason == "length" and out.token_ids == g_full[:m]


# --- stop token ids and EOS -------------------------------------------------------------------------------------


def first_occurrences(tokens: list[int]) -> dict[int, int]:
    first: dict[int, int] = {}
    for i, t in enumerate(tokens):
        first.setdefault(t, i)
    return first


def test_stop_token_ids(llm):
    rng = random.Random()
    prompt, seed, adapter = rand_prompt(rng), rng.randrange(2**63), rng.choice([None, *ADAPTERS])
    full = llm.generate([prompt], seeded(seed), adapters=[adapter])[0].token_ids
    first = first_occurrences(full)
    a, b = rng.sample(sorted(first), 2)
    k = min(first[a], first[b])
    unseen = next(t for t in range(3, VOCAB) if t not in first)
    cases = [
        ([a], first[a], "stop"),
        ([b, a], k, "stop"),  # the earliest of several
        ([unseen], N - 1, "length"),  # never generated: runs to max_tokens
    ]
    for ignore_eos in (True, False):  # ignore_eos does not turn stop_token_ids off
        params = [seeded(seed, stop_token_ids=ids, ignore_eos=ignore_eos) for ids, _, _ in cases]
        outs = llm.generate([prompt] * len(cases), params, adapters=[adapter] * len(cases))
        for (ids, end, reason), out in zip(cases, outs):
            if not ignore_eos and 2 in full[: end + 1]:
                continue  # the model's own EOS came first
            assert out.finish_reason == reason, (ids, out)
            assert out.token_ids == full[: end + 1], "the stop token is kept in token_ids"


def with_eos(model_dir: Path, out: Path, eos) -> Path:
    """A copy of the model whose config (and generation config) give `eos` as the EOS id(s)."""
    shutil.copytree(model_dir, out)
    for name in ("config.json", "generation_config.json"):
        path = out / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = eos
            path.write_text(json.dumps(cfg))
    return out


def test_eos_stops_unless_ignore_eos(model_dir, root):
    rng = random.Random()
    base = LLM(str(model_dir), kernels="torch", max_lora_rank=64, pool_bytes=8 << 20)
    prompt, seed = rand_prompt(rng), rng.randrange(2**63)
    full = base.generate([prompt], seeded(seed))[0].token_ids
    greedy_full = base.generate([prompt], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))[0].token_ids
    first = first_occurrences(full)
    late = sorted(first, key=first.get)[-2:]  # the two tokens whose first occurrence is latest
    eos_one = late[0]
    eos_dir = with_eos(model_dir, root / f"eos-{rng.randrange(10**9)}", [late[1], eos_one])  # a list of EOS ids
    llm = LLM(str(eos_dir), kernels="torch", max_lora_rank=64, pool_bytes=8 << 20)
    assert set(llm.engine.model_config.eos_token_ids) == set(late)
    k = min(first[t] for t in late)

    stop, ignore = llm.generate([prompt, prompt], [seeded(seed, ignore_eos=False), seeded(seed, ignore_eos=True)])
    assert stop.finish_reason == "stop" and stop.token_ids == full[: k + 1]
    assert ignore.finish_reason == "length" and ignore.token_ids == full

    # Greedy too: the first greedy token that is an EOS id ends the output.
    g_eos = greedy_full[rng.randrange(N)]
    g_dir = with_eos(model_dir, root / f"eos-{rng.randrange(10**9)}", g_eos)
    g = LLM(str(g_dir), kernels="torch", max_lora_rank=64, pool_bytes=8 << 20)
    out = g.generate([prompt], SamplingParams(max_tokens=N, temperature=0.0))[0]
    end = greedy_full.index(g_eos)
    assert out.finish_reason == "stop" and out.token_ids == greedy_full[: end + 1]
    out = g.generate([prompt], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == greedy_full


# --- stop strings and streamed text -----------------------------------------------------------------------------


def stream(engine: EngineCore, requests: list[tuple[list[int] | str, SamplingParams, str | None]]):
    """Run requests to the end through step(); per request, (the streamed outputs, the final output)."""
    ids = [engine.add_request(p, sp, a).request_id for p, sp, a in requests]
    steps: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            assert not steps[out.request_id] or not steps[out.request_id][-1].finished
            steps[out.request_id].append(out)
    return [(steps[rid], steps[rid][-1]) for rid in ids]


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def check_stream(outs: list[RequestOutput], stop: tuple[str, ...] = ()) -> None:
    final = outs[-1]
    assert final.finished and all(not o.finished for o in outs[:-1])
    assert "".join(o.new_text for o in outs) == final.text
    assert [t for o in outs for t in o.new_token_ids] == final.token_ids
    for i, o in enumerate(outs):
        assert o.text == "".join(x.new_text for x in outs[: i + 1])
        for s in stop:
            assert s not in o.new_text and s not in o.text


def pick_stop_strings(rng: random.Random, text: str, count: int) -> list[tuple[str, int]]:
    """Substrings of text (2 to 4 characters, no replacement characters) with the index of their first
    occurrence; several distinct ones, as available."""
    found: dict[str, int] = {}
    starts = list(range(len(text)))
    rng.shuffle(starts)
    for i in starts:
        s = text[i : i + rng.randint(2, 4)]
        if len(s) >= 2 and "\ufffd" not in s and s.strip() and s not in found:
            found[s] = text.find(s)
        if len(found) >= count:
            break
    return list(found.items())


def test_stop_strings_cut_the_text_and_stream(llm):
    engine = llm.engine
    tok = llm.tokenizer
    rng = random.Random()
    for _ in range(4):
        prompt, seed, adapter = rand_prompt(rng), rng.randrange(2**63), rng.choice([None, *ADAPTERS])
        [(outs, ref)] = stream(engine, [(prompt, seeded(seed, 40), adapter)])
        check_stream(outs)
        full = ref.token_ids
        assert ref.finish_reason == "length"
        assert ref.text == decode(tok, full), "streamed text differs from decoding all tokens at once"
        picks = pick_stop_strings(rng, ref.text, 4)
        assert picks, ref.text
        # One request per stop string, one with all of them, one that never matches. With several, the
        # output ends where one is first complete (the smallest end; at equal ends, the longer one).
        cases = [([s], i) for s, i in picks]
        cases.append(([s for s, _ in picks], min(picks, key=lambda p: (p[1] + len(p[0]), p[1]))[1]))
        never = "\x00never\x00"
        cases.append(([never], None))
        results = stream(engine, [(prompt, seeded(seed, 40, stop=stops), adapter) for stops, _ in cases])
        for (stops, at), (outs, final) in zip(cases, results):
            check_stream(outs, tuple(stops))
            assert final.token_ids == full[: len(final.token_ids)]
            if at is None:
                assert final.finish_reason == "length" and final.text == ref.text
                continue
            assert final.finish_reason == "stop", (stops, ref.text, final.text)
            assert final.text == ref.text[:at], (stops, ref.text, final.text)
            # Output ends on the token that completed the stop string: its text holds a stop string.
            assert any(s in decode(tok, final.token_ids) for s in stops)
    assert engine.stats().kv_pages == 0


def test_stop_strings_beside_other_requests(llm):
    """Several streams at once, each with its own stop strings, equal the same requests run alone."""
    engine = llm.engine
    rng = random.Random()
    reqs = []
    for _ in range(8):
        prompt, seed, adapter = rand_prompt(rng), rng.randrange(2**63), rng.choice([None, *ADAPTERS])
        [(_, ref)] = stream(engine, [(prompt, seeded(seed, 32), adapter)])
        picks = pick_stop_strings(rng, ref.text, 2)
        reqs.append((prompt, seeded(seed, 32, stop=[s for s, _ in picks] or None), adapter))
    alone = [stream(engine, [r])[0][1] for r in reqs]
    together = stream(engine, reqs)
    for r, a, (outs, final) in zip(reqs, alone, together):
        check_stream(outs, r[1].stop)
        assert (final.token_ids, final.text, final.finish_reason) == (a.token_ids, a.text, a.finish_reason)


def test_text_prompt_is_tokenized(llm):
    rng = random.Random()
    text = " ".join("".join(rng.choice("kalomineru ") for _ in range(rng.randint(3, 9))) for _ in range(6))
    ids = list(llm.tokenizer(text, add_special_tokens=True)["input_ids"])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a, b = llm.generate([text, ids], params)
    assert a.prompt_token_ids == ids and a.token_ids == b.token_ids and a.text == b.text
