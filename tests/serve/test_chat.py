"""Chat prompts: a Hugging Face directory's chat_template, kept by our tokenizer through a checkpoint, renders
the messages as transformers' apply_chat_template does; without one, the plain template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from plainformer.data.tokenizers import BPETokenizer, CharTokenizer, load_tokenizer
from plainformer.hf.tokenizer_files import load_hf_tokenizer, save_hf_tokenizer
from plainformer.serve.chat import chat_prompt
from plainformer.serve.protocol import APIError

# ChatML with a system default, bos_token, a loop and a rule the messages may break.
TEMPLATE = ("{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n"
            "{% endif %}{% for message in messages %}{% if message['role'] == 'tool' %}"
            "{{ raise_exception('tool messages are not supported') }}{% endif %}"
            "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "To be, or not to be? "}, {"role": "assistant", "content": "That is it."},
            {"role": "user", "content": "Whether 'tis nobler"}]


@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory):
    tokenizer = BPETokenizer.train("To be, or not to be, that is the question. " * 50, vocab_size=300)
    tokenizer.chat_template = TEMPLATE
    return save_hf_tokenizer(tokenizer, tmp_path_factory.mktemp("hf"))


def test_a_hf_chat_template_renders_as_transformers_renders_it(hf_directory):
    ours = load_hf_tokenizer(hf_directory)
    assert ours.chat_template == TEMPLATE
    theirs = AutoTokenizer.from_pretrained(hf_directory)
    expected = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat_prompt(ours, MESSAGES) == expected
    assert ours.encode_text(expected) == theirs(expected, add_special_tokens=False)["input_ids"]


def test_the_template_survives_a_checkpoints_tokenizer_files(hf_directory, tmp_path):
    load_hf_tokenizer(hf_directory).save(tmp_path)
    assert load_tokenizer(tmp_path).chat_template == TEMPLATE


def test_a_rule_of_the_template_is_a_400_naming_the_messages(hf_directory):
    with pytest.raises(APIError, match="tool messages are not supported") as raised:
        chat_prompt(load_hf_tokenizer(hf_directory), [{"role": "tool", "content": "42"}])
    assert raised.value.status == 400 and raised.value.param == "messages"


def test_without_a_template_each_turn_is_its_role_in_capitals():
    tokenizer = CharTokenizer("abc")
    assert chat_prompt(tokenizer, [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}]) == \
        "SYSTEM:\nbe\n\nUSER:\nhi\n\nASSISTANT:\n"
