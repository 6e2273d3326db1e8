"""Bad input at the engine's front door: refused with an error that names the problem, and nothing changes.

Adapters are made with real PEFT on a tiny random model; each refusal is tried on an engine that already
serves one good adapter and has finished a request, and the engine's visible state (adapter names and
versions, pool and engine stats, queues) must be identical before and after, with the good adapter still
giving the same greedy tokens.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from factories import edit_adapter_config, make_peft_adapter, make_tiny_model
from loraplex.engine import LLM, SamplingParams
from loraplex.errors import AdapterError, AdapterNotFoundError, CapacityError, RequestError

CONTEXT = 64  # max_position_embeddings of the tiny model
VOCAB = 257
WEIGHTS = "adapter_model.safetensors"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
GREEDY_LOGITS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_logits=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matrices: intra-op threads only add synchronisation (and stall badly on a loaded machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"), "qwen2", max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def good_dir(model_dir, tmp_path_factory) -> Path:
    return make_peft_adapter(model_dir, tmp_path_factory.mktemp("good") / "a", r=8,
                             target_modules=("q_proj", "v_proj", "down_proj"))


def rand_prompt(rng: random.Random, lo: int = 3, hi: int = 30) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))]


def new_llm(model_dir: Path, **kw) -> LLM:
    kw.setdefault("pool_bytes", 4 << 20)
    return LLM(str(model_dir), kernels="torch", max_lora_rank=64, **kw)


@dataclass
class Served:
    llm: LLM
    prompts: list[list[int]]
    adapters: list[str | None]
    tokens: list[list[int]]
    logits: list[torch.Tensor]

    def generate(self) -> tuple[list[list[int]], list[torch.Tensor]]:
        outs = self.llm.generate(self.prompts, GREEDY_LOGITS, adapters=self.adapters)
        assert all(o.finish_reason == "length" for o in outs)
        return [o.token_ids for o in outs], [torch.cat([o.prompt_logits, o.logits]) for o in outs]

    def check_unchanged(self) -> None:
        tokens, logits = self.generate()
        assert tokens == self.tokens, "greedy tokens changed"
        for ours, ref in zip(logits, self.logits):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def served(model_dir, good_dir) -> Served:
    llm = new_llm(model_dir)
    llm.load_adapter("good", good_dir)
    rng = random.Random()
    p = rand_prompt(rng)
    prompts = [p, p, rand_prompt(rng), rand_prompt(rng)]
    adapters = ["good", None, "good", None]
    s = Served(llm, prompts, adapters, [], [])
    s.tokens, s.logits = s.generate()  # requests have finished: the good adapter is resident and idle
    assert (s.logits[0] - s.logits[1]).abs().max() > 1e-2, "the adapter should change the logits"
    return s


def snapshot(llm: LLM) -> dict:
    e = llm.engine
    return dict(
        names=e.adapters.names(),
        keys={n: e.adapters.resolve(n) for n in e.adapters.names()},
        pool=e.pager.stats(),
        engine=e.stats(),
        requests=sorted(e.requests),
        waiting=len(e.scheduler.waiting),
        running=len(e.scheduler.running),
        unfinished=e.has_unfinished(),
    )


# --- refused adapters -----------------------------------------------------------------------------------------


def _pickle_weights(adapter_dir: Path, name: str) -> Path:
    """Move the weights into a torch.save pickle named `name`, with a trap that would run if unpickled."""
    state = dict(load_file(adapter_dir / WEIGHTS))
    state["trap"] = _UnpickleTrap(adapter_dir.parent / "UNPICKLED")
    (adapter_dir / WEIGHTS).unlink()
    torch.save(state, adapter_dir / name)
    return adapter_dir


class _UnpickleTrap:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _ia3(model_dir: Path, out: Path) -> Path:
    from peft import IA3Config, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg = IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), cfg).save_pretrained(out)
    return out


def _other_shape(model_dir: Path, out: Path) -> Path:
    other = make_tiny_model(out.parent / "other-model", "qwen2", intermediate_size=160, max_position_embeddings=CONTEXT)
    return make_peft_adapter(other, out, r=4, target_modules=("q_proj", "gate_proj", "down_proj"))


def _without(filename: str):
    def build(model_dir: Path, out: Path) -> Path:
        a = make_peft_adapter(model_dir, out, r=4)
        (a / filename).unlink()
        return a
    return build


def _nan_weight(model_dir: Path, out: Path) -> Path:
    """A NaN in one lora_B: the engine packs adapters as it loads them, and the check rides on the packing."""
    a = make_peft_adapter(model_dir, out, r=4)
    tensors = load_file(a / WEIGHTS)
    key = sorted(k for k in tensors if "lora_B" in k)[len(tensors) // 4]
    tensors[key][-1, -1] = float("nan")
    save_file(tensors, a / WEIGHTS)
    return a


# name -> (builder(model_dir, out_dir), fragments the message must contain)
BAD_ADAPTERS = {
    "dora": (lambda m, o: make_peft_adapter(m, o, r=4, use_dora=True), ["DoRA", "use_dora"]),
    "modules_to_save": (lambda m, o: make_peft_adapter(m, o, r=4, modules_to_save=["lm_head"]),
                        ["modules_to_save", "lm_head"]),
    "embed_tokens": (lambda m, o: make_peft_adapter(m, o, r=4, target_modules=("q_proj", "embed_tokens")),
                     ["embed_tokens", "not supported"]),
    "lm_head": (lambda m, o: make_peft_adapter(m, o, r=4, target_modules=("v_proj", "lm_head")),
                ["lm_head", "not supported"]),
    "bias_all": (lambda m, o: make_peft_adapter(m, o, r=4, bias="all"), ["bias='all'"]),
    "ia3": (_ia3, ["peft_type 'IA3'", "LORA"]),
    "rank_too_big": (lambda m, o: make_peft_adapter(m, o, r=96, target_modules=("q_proj",)),
                     ["rank 96", "max_lora_rank 64"]),
    "rank_pattern_too_big": (lambda m, o: make_peft_adapter(m, o, r=4, rank_pattern={"v_proj": 80}),
                             ["v_proj has rank 80", "max_lora_rank 64"]),
    "other_model": (_other_shape, ["mlp.", "different base model"]),
    "no_config": (_without("adapter_config.json"), ["adapter_config.json is missing"]),
    "no_weights": (_without(WEIGHTS), [f"{WEIGHTS} is missing"]),
    "pickle_bin": (lambda m, o: _pickle_weights(make_peft_adapter(m, o, r=4), "adapter_model.bin"),
                   ["pickle", "adapter_model.bin", "never unpickled"]),
    "pickle_named_safetensors": (lambda m, o: _pickle_weights(make_peft_adapter(m, o, r=4), WEIGHTS),
                                 ["zip archive", "never unpickled"]),
    "not_a_folder": (lambda m, o: o / "does-not-exist", ["does not exist"]),
    "nan_weights": (_nan_weight, ["lora_B", "NaN or Inf"]),
    "config_hides_dora": (
        lambda m, o: _edited(make_peft_adapter(m, o, r=4, use_dora=True), use_dora=False),
        ["lora_magnitude_vector", "DoRA"],
    ),
}


def _edited(adapter_dir: Path, **changes) -> Path:
    edit_adapter_config(adapter_dir, **changes)
    return adapter_dir


@pytest.fixture(scope="module")
def bad_dirs(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    dirs = {}
    for kind, (build, _) in BAD_ADAPTERS.items():
        (root / kind).mkdir()
        dirs[kind] = Path(build(model_dir, root / kind / "adapter"))
    return dirs


@pytest.mark.parametrize("as_name", ["fresh-name", "good"])  # "good": a refused re-load must keep the old version
@pytest.mark.parametrize("kind", list(BAD_ADAPTERS))
def test_refused_adapter_changes_nothing(served, bad_dirs, kind, as_name):
    llm = served.llm
    before = snapshot(llm)
    with pytest.raises(AdapterError) as e:
        llm.load_adapter(as_name, bad_dirs[kind])
    message = str(e.value)
    assert repr(as_name) in message, message  # says which adapter
    for fragment in BAD_ADAPTERS[kind][1]:
        assert fragment in message, (fragment, message)
    assert not (bad_dirs[kind].parent / "UNPICKLED").exists(), "a pickle was unpickled"
    assert snapshot(llm) == before
    llm.engine.pager.check_integrity()
    with pytest.raises(AdapterNotFoundError):
        llm.engine.adapters.resolve("fresh-name")
    served.check_unchanged()


def test_refused_loads_in_a_row_then_good_reload(served, bad_dirs, good_dir):
    """Many refusals leave no residue; a good re-load under the same name afterwards is a new version."""
    llm = served.llm
    before = snapshot(llm)
    for kind in BAD_ADAPTERS:
        with pytest.raises(AdapterError):
            llm.load_adapter("good", bad_dirs[kind])
    assert snapshot(llm) == before
    old = llm.engine.adapters.resolve("good")
    new = llm.load_adapter("good", good_dir)
    assert new != old and new.name == old.name == "good"
    served.check_unchanged()  # same weights, new version: same tokens and logits
    stats = llm.engine.pager.stats()
    assert stats.resident_adapters == 1 and stats.kv_pages == 0  # the old version's pages went back
    llm.engine.pager.check_integrity()


def test_adapter_larger_than_the_pool_is_refused(model_dir, good_dir):
    llm = new_llm(model_dir, pool_bytes=6 * page_bytes(model_dir))  # 6 pages; the good adapter needs more
    before = snapshot(llm)
    with pytest.raises(CapacityError, match="'good' needs .* pool pages"):
        llm.load_adapter("good", good_dir)
    assert snapshot(llm) == before and before["names"] == []


# --- refused requests -----------------------------------------------------------------------------------------


def page_bytes(model_dir: Path) -> int:
    probe = new_llm(model_dir, pool_bytes=1 << 20)
    return probe.engine.pager.geometry.page_bytes


@pytest.fixture
def llm(model_dir, good_dir) -> LLM:
    llm = new_llm(model_dir)
    llm.load_adapter("good", good_dir)
    llm.generate([rand_prompt(random.Random())], GREEDY, adapters=["good"])
    return llm


def refused_request(llm: LLM, error: type, fragments: list[str], prompts, params=GREEDY, adapters=None) -> str:
    """LLM.generate refuses; nothing is queued and the pool is unchanged (also for the valid prompts
    queued before the bad one, which generate must roll back)."""
    before = snapshot(llm)
    with pytest.raises(error) as e:
        llm.generate(prompts, params, adapters=adapters)
    message = str(e.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    after = snapshot(llm)
    assert after == before, (before, after)
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    llm.engine.pager.check_integrity()
    return message


def test_prompt_longer_than_the_context(llm):
    rng = random.Random()
    for n in (CONTEXT, CONTEXT + 1, CONTEXT + rng.randint(2, 500)):
        long = [rng.randrange(VOCAB) for _ in range(n)]
        refused_request(llm, RequestError, [f"{n} tokens", f"context is {CONTEXT}"],
                        [rand_prompt(rng), long], adapters=["good", None])


def test_prompt_just_inside_the_context_stops_at_the_context(llm):
    rng = random.Random()
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for n, expect in ((CONTEXT - 1, 1), (CONTEXT - 4, 4)):
        out = llm.generate([[rng.randrange(VOCAB) for _ in range(n)]], params, adapters=["good"])[0]
        assert out.finish_reason == "length" and len(out.token_ids) == expect
    assert llm.engine.stats().kv_pages == 0


def test_rolled_back_requests_release_their_adapter(llm):
    """generate rolls back the good requests queued before a bad one: their hold on the adapter goes
    too, so unloading the adapter frees its pages."""
    rng = random.Random()
    refused_request(llm, RequestError, ["context"],
                    [rand_prompt(rng), rand_prompt(rng), [5] * (CONTEXT + 3)], adapters=["good", "good", "good"])
    assert llm.engine.pager.stats().adapter_pages > 0  # resident from the finished request
    llm.unload_adapter("good")
    stats = llm.engine.pager.stats()
    assert stats.adapter_pages == 0 and stats.resident_adapters == 0 and stats.free_pages == stats.total_pages
    llm.engine.pager.check_integrity()


def test_unknown_adapter(llm):
    rng = random.Random()
    msg = refused_request(llm, AdapterNotFoundError, ["'nope'", "not loaded"],
                          [rand_prompt(rng), rand_prompt(rng)], adapters=["good", "nope"])
    assert not msg.startswith("'")  # a KeyError subclass, but the message is not quoted
    # Straight through the engine too, and after an unload the name is unknown.
    before = snapshot(llm)
    with pytest.raises(AdapterNotFoundError, match="'nope'"):
        llm.engine.add_request(rand_prompt(rng), GREEDY, adapter="nope")
    assert snapshot(llm) == before
    llm.unload_adapter("good")
    refused_request(llm, AdapterNotFoundError, ["'good'"], [rand_prompt(rng)], adapters=["good"])
    with pytest.raises(AdapterNotFoundError, match="'good'"):
        llm.unload_adapter("good")


def test_text_prompt_without_tokenizer(llm):
    assert llm.tokenizer is None
    rng = random.Random()
    refused_request(llm, RequestError, ["tokenizer", "token-id lists"], ["hello there"])
    refused_request(llm, RequestError, ["tokenizer"], [rand_prompt(rng), "hello"], adapters=["good", None])
    # Stop strings need a tokenizer as well.
    refused_request(llm, RequestError, ["stop strings", "tokenizer"], [rand_prompt(rng)],
                    params=SamplingParams(max_tokens=4, stop=["x"]))


def test_out_of_vocabulary_token_ids(llm):
    rng = random.Random()
    for bad in (VOCAB, VOCAB + rng.randint(1, 10**6), -1, -rng.randint(2, 10**6)):
        prompt = rand_prompt(rng)
        prompt.insert(rng.randrange(len(prompt) + 1), bad)
        refused_request(llm, RequestError, [str(bad), "outside the vocabulary", f"0..{VOCAB - 1}"],
                        [rand_prompt(rng), prompt], adapters=["good", "good"])
    refused_request(llm, RequestError, ["empty"], [rand_prompt(rng), []])


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(seed=1.5), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop=[3]), "stop"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_bad_sampling_params(kwargs, fragment):
    with pytest.raises(RequestError, match=fragment):
        SamplingParams(**kwargs)


def test_duplicate_request_id(llm):
    rng = random.Random()
    first = llm.engine.add_request(rand_prompt(rng), GREEDY, adapter="good", request_id="dup")
    before = snapshot(llm)
    with pytest.raises(RequestError, match="'dup'"):
        llm.engine.add_request(rand_prompt(rng), GREEDY, request_id="dup")
    assert snapshot(llm) == before and llm.engine.requests["dup"] is first
    finals = []
    while llm.engine.has_unfinished():
        finals += [o for o in llm.engine.step() if o.finished]
    assert [o.request_id for o in finals] == ["dup"] and len(finals[0].token_ids) == GREEDY.max_tokens


def test_pool_too_small_for_a_request(model_dir):
    pb = page_bytes(model_dir)
    small = new_llm(model_dir, pool_bytes=6 * pb)  # 6 pages = 3 KV blocks of 16 tokens on 2 layers
    tiny_adapter = make_peft_adapter(model_dir, model_dir.parent / "rank1", r=1, target_modules=("q_proj", "v_proj"))
    small.load_adapter("r1", tiny_adapter)
    geo = small.engine.pager.geometry
    r1 = small.engine.adapters.host(small.engine.adapters.resolve("r1"))
    assert geo.num_pages == 6 and geo.adapter_num_pages(r1) == 1
    rng = random.Random()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    # The prompt alone is too long for the pool.
    refused_request(small, CapacityError, ["pool pages", "the pool has 6"], [rand_prompt(rng), [7] * 49], params=one)
    # The prompt fits, but not beside its adapter.
    refused_request(small, CapacityError, ["pool pages"], [[7] * 40], params=one, adapters=["r1"])
    # The prompt fits, but the output it may grow to does not.
    refused_request(small, CapacityError, ["prompt + max_tokens"], [[7] * 10],
                    params=SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    # Right at the limit everything is served (the last sampled token never needs KV).
    outs = small.generate([[7] * 40, [8] * 30, [9] * 10], [one, SamplingParams(max_tokens=2, temperature=0.0,
                          ignore_eos=True), SamplingParams(max_tokens=22, temperature=0.0, ignore_eos=True)],
                          adapters=[None, "r1", "r1"])
    assert [len(o.token_ids) for o in outs] == [1, 2, 22]
    stats = small.engine.pager.stats()
    assert stats.kv_pages == 0
    small.engine.pager.check_integrity()
