"""IncrementalDetokenizer against a real byte-level BPE tokenizer trained here (nothing downloaded)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.stop_checker import StopChecker

CORPUS = [
    "Hello world, this is a small test of streaming text.",
    "Café crème brûlée à la carte, naïve façade, señor Müller.",
    "日本語のテキストです。東京は大きい都市です。",
    "Emoji time 😀🎉👍🏽 and a flag 🇫🇷 and a fox 🦊!",
    "Ελληνικά και русский текст тоже есть здесь.",
    "The quick brown fox jumps over the lazy dog.",
]
# Characters the tokenizer never saw in training: they fall back to (multi-)byte tokens.
UNSEEN = "ß✓🚀中文한국어ŁódźØ€"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is a token
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _random_text(rng: random.Random, n_chars: int) -> str:
    pool = "".join(CORPUS) + UNSEEN + " " * 20
    return "".join(rng.choice(pool) for _ in range(n_chars))


def _random_chunks(rng: random.Random, ids: list[int], max_chunk: int = 3) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def _stream(tokenizer, prompt: list[int], output: list[int], rng: random.Random, final: str) -> list[str]:
    """Push output in random chunks; check every intermediate text is a prefix of `final`."""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = []
    for chunk in _random_chunks(rng, output):
        deltas.append(detok.push(chunk))
        assert detok.text == "".join(deltas)
        assert final.startswith(detok.text), "streamed text had to be retracted"
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas) == final
    return deltas


def test_decoding_real_text_matches_full_decode_and_never_emits_partial_characters(tokenizer):
    rng = random.Random()
    texts = CORPUS + [_random_text(rng, rng.randint(1, 120)) for _ in range(60)]
    for text in texts:
        output = tokenizer.encode(text, add_special_tokens=False)
        prompt = tokenizer.encode(rng.choice(CORPUS), add_special_tokens=False)[: rng.randint(0, 12)]
        final = tokenizer.decode(output, skip_special_tokens=True)
        assert final == text
        deltas = _stream(tokenizer, prompt, output, rng, final)
        assert deltas[-1] == ""  # valid text ends on a whole character: nothing left to flush
        assert not any("\ufffd" in d for d in deltas)


def test_random_token_ids_round_trip(tokenizer):
    # Random ids (special tokens included) decode to stray bytes and U+FFFD; streaming must still
    # reproduce the full decode exactly, without ever taking back text it emitted.
    rng = random.Random()
    vocab = len(tokenizer)
    for _ in range(300):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 80))]
        _stream(tokenizer, prompt, output, rng, tokenizer.decode(output, skip_special_tokens=True))


def test_a_character_split_over_tokens_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("a🦊b", add_special_tokens=False)
    fox_tokens = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert len(fox_tokens) >= 2  # the fox is split over several byte tokens by this vocabulary
    detok = IncrementalDetokenizer(tokenizer, [])
    seen = [detok.push([i]) for i in ids]
    assert "".join(seen) == "a🦊b"
    assert "🦊" in seen  # emitted whole, in one delta, once its last byte arrived
    assert seen.count("") == len(fox_tokens) - 1


def test_prompt_ending_inside_a_character_does_not_leak_into_the_output(tokenizer):
    rng = random.Random()
    for _ in range(20):
        ids = tokenizer.encode("x " + rng.choice("😀🎉🦊🚀") + _random_text(rng, 20), add_special_tokens=False)
        # Cut right after the first byte token of the emoji: the prompt ends mid-character.
        cut = next(i for i, t in enumerate(ids) if "\ufffd" in tokenizer.decode([t])) + 1
        prompt, output = ids[:cut], ids[cut:]
        _stream(tokenizer, prompt, output, rng, tokenizer.decode(output, skip_special_tokens=True))


def test_special_tokens_are_skipped_and_keep_context(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello", add_special_tokens=False))
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    out = [eos, bos] + tokenizer.encode(" world", add_special_tokens=False) + [eos]
    assert "".join(detok.push([t]) for t in out) + detok.flush() == " world"
    assert detok.num_output_tokens == len(out)


def test_window_stays_small_on_long_outputs(tokenizer):
    rng = random.Random()
    text = " ".join(rng.choice(CORPUS) for _ in range(150))
    output = tokenizer.encode(text, add_special_tokens=False)
    assert len(output) > 3000
    detok = IncrementalDetokenizer(tokenizer, [])
    widest = 0
    for t in output:
        detok.push([t])
        widest = max(widest, detok.window_tokens)
    assert detok.text == text
    assert widest <= 12  # a few tokens of context plus one unfinished character, never the output


def test_window_stays_small_on_endless_invalid_bytes(tokenizer):
    # Single-byte tokens of non-ASCII bytes (lead and continuation bytes) in random order: the text
    # keeps ending in U+FFFD, yet whatever is settled must be released, not re-decoded forever.
    byte_tokens = [i for i in range(len(tokenizer))
                   if len(tokenizer.convert_ids_to_tokens(i)) == 1 and tokenizer.decode([i]) == "\ufffd"]
    assert len(byte_tokens) == 128
    rng = random.Random()
    for _ in range(5):
        output = [rng.choice(byte_tokens) for _ in range(1500)]
        detok = IncrementalDetokenizer(tokenizer, [])
        widest = 0
        for t in output:
            detok.push([t])
            widest = max(widest, detok.window_tokens)
        detok.flush()
        assert detok.text == tokenizer.decode(output, skip_special_tokens=True)
        assert widest <= 20  # structurally at most ~17: 8 held tokens + the previous window


def test_stop_string_across_tokens_with_streamed_text(tokenizer):
    # The detokenizer's deltas feed the stop checker, as in the engine's output step.
    rng = random.Random()
    for _ in range(40):
        text = _random_text(rng, 80) + "brûlée 🦊 done" + _random_text(rng, 30)
        stop = rng.choice(["brûlée", "🦊", "e 🦊 d", "done"])
        output = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, [])
        checker = StopChecker([stop])
        streamed = ""
        for chunk in _random_chunks(rng, output):
            update = checker.push(detok.push(chunk))
            streamed += update.emit
            if update.stopped:
                break
        else:
            streamed += checker.push(detok.flush()).emit
        assert checker.stopped and checker.stop_string == stop
        assert streamed == checker.text == text[: text.index(stop)]
