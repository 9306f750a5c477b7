"""RL's chat-message prompts against transformers: rendered with the chat template and the generation prompt, their
token ids are apply_chat_template's; text prompts beside them are unchanged, and bad messages name the record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lm_train.errors import DataError
from lm_train.post.rl.prompts import chat_renderer, load_prompts

SPECIAL = ["<|user|>", "<|assistant|>", "<|end|>"]
WORDS = ["[UNK]", *SPECIAL, "what", "is", "+", "=", *[str(i) for i in range(10)]]
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT = [{"role": "user", "content": "what is 3 + 4"}]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIAL)
    path = tmp_path_factory.mktemp("chat") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def _write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def test_chat_prompts_are_apply_chat_templates_ids(tokenizer_file, tmp_path):
    import transformers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    url = _write(tmp_path / "p.jsonl", [{"prompt": CHAT, "answer": "7"}, {"prompt": "3 + 4", "answer": "7"}])
    chat = chat_renderer(str(tokenizer_file), "prompt", TEMPLATE)
    chat_prompt, text_prompt = load_prompts([url], tokenizer, "prompt", [], 32, 4, chat)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    reference.chat_template = TEMPLATE
    expected = reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(chat_prompt.ids) == list(expected)
    assert chat_prompt.ids[-1] == WORDS.index("<|assistant|>")  # the generation prompt ends it
    assert list(text_prompt.ids) == tokenizer.encode("3 + 4", add_special_tokens=False).ids
    assert chat_prompt.record["prompt"] == CHAT and chat_prompt.where.endswith("p.jsonl:1")


def test_bad_chat_prompts_name_the_record(tokenizer_file, tmp_path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    url = _write(tmp_path / "p.jsonl", [{"prompt": "1 + 2"}, {"prompt": [{"content": "1 + 2"}]}])
    with pytest.raises(DataError, match=r"p\.jsonl:2: the chat messages in 'prompt' cannot be rendered: .*no 'role'"):
        load_prompts([url], tokenizer, "prompt", [], 32, 4, chat_renderer(str(tokenizer_file), "prompt", TEMPLATE))
    # A tokenizer.json file carries no chat template: the error says where one is needed, and how to give it.
    with pytest.raises(DataError, match=r"p\.jsonl:2: the record's prompt is chat messages, but no chat template"):
        load_prompts([url], tokenizer, "prompt", [], 32, 4, chat_renderer(str(tokenizer_file), "prompt", None))
