"""jaxinfer's light Tokenizer agrees with HF transformers' on the same folder."""

import pytest

from jaxinfer.tokenizer import Tokenizer
from tests.models.test_gguf_and_smollm2 import TOKENIZER_STRINGS

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def toks():
    from jaxinfer.checkpoints.default_model import ensure_default_model

    d = ensure_default_model()
    return Tokenizer.from_pretrained(d), transformers.AutoTokenizer.from_pretrained(d)


def test_encode_decode_match_hf(toks):
    ours, hf = toks
    for s in TOKENIZER_STRINGS:
        ids = ours(s)["input_ids"]
        assert ids == hf(s)["input_ids"]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip)
    assert ours.eos_token_id == hf.eos_token_id and ours.bos_token_id == hf.bos_token_id


def test_chat_template_matches_hf(toks):
    ours, hf = toks
    convs = [[{"role": "user", "content": "Hi there, ünïcode?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]]
    for conv in convs:
        for gen in (True, False):
            a = ours.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            b = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert a == b
            ids = hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            assert ours.apply_chat_template(conv, add_generation_prompt=gen) == ids
    with pytest.raises(ValueError, match="chat template error: nope"):
        ours.apply_chat_template([], chat_template="{{ raise_exception('nope') }}")
