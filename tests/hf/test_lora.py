"""LoRA against Hugging Face PEFT: with copied A and B, a Llama and a BERT give PEFT's outputs unmerged,
merged and unmerged again; on disk (plainformer.hf.lora), PEFT loads what save_lora writes and load_lora
reads what PEFT writes; a GPT-2-layout model round-trips in our names; a file that does not fit the model is
refused naming it."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import plainformer as pf
from plainformer.hf.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_lora, save_lora
from plainformer.nn.lora import lora_layers

TOLERANCE = 1e-5  # fp32 against PEFT


def _peft():
    """peft, imported by the tests that use it rather than when the suite is collected: importing it imports
    triton, which tests/nn/test_flash_triton.py must import first, with TRITON_INTERPRET=1."""
    import peft

    return peft


def _randomize_b(model) -> None:
    with torch.no_grad():
        for layer in lora_layers(model):
            layer.lora_B.normal_(generator=torch.Generator().manual_seed(layer.lora_B.numel()))


def _llama_directory(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=31, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def _hf_llama(directory):
    return transformers.LlamaForCausalLM.from_pretrained(directory).eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, 31, (2, 9), generator=torch.Generator().manual_seed(1))


def test_peft_loads_our_adapter_of_a_llama_with_equal_logits(tmp_path):
    directory = _llama_directory(tmp_path)
    ours = pf.add_lora(pf.load_hf(directory), r=4, alpha=8.0, targets=("W_q", "W_v", "W_2")).eval()
    _randomize_b(ours)
    save_lora(ours, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"] and config["r"] == 4
    theirs = _peft().PeftModel.from_pretrained(_hf_llama(directory), tmp_path / "adapter").eval()
    idx = _tokens()
    with torch.no_grad():
        assert (ours(idx)[0] - theirs(input_ids=idx).logits).abs().max() <= TOLERANCE


def test_peft_loads_our_adapter_of_a_mixtral_with_equal_logits(tmp_path):
    torch.manual_seed(0)
    config = pf.GPTConfig(vocab_size=31, block_size=32, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16, d_ff=24,
                          pos_encoding="rope", norm="rmsnorm", activation="swiglu", n_experts=4, top_k=2,
                          tie_weights=False, z_loss_coef=0.0)
    pf.save_hf(pf.GPT(config), tmp_path / "mixtral")
    ours = pf.add_lora(pf.load_hf(tmp_path / "mixtral"), r=4, alpha=8.0, targets=("W_q", "W_v")).eval()
    _randomize_b(ours)
    save_lora(ours, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())["target_modules"] == ["q_proj", "v_proj"]
    base = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "mixtral").eval()
    theirs = _peft().PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    idx = _tokens()
    with torch.no_grad():
        assert (ours(idx)[0] - theirs(input_ids=idx).logits).abs().max() <= TOLERANCE


def test_we_load_an_adapter_peft_saved_with_equal_logits(tmp_path):
    directory = _llama_directory(tmp_path)
    config = _peft().LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    theirs = _peft().get_peft_model(_hf_llama(directory), config).eval()
    theirs.save_pretrained(tmp_path / "adapter")
    ours = load_lora(pf.load_hf(directory), tmp_path / "adapter").eval()
    assert {n.rpartition(".")[2] for n, m in ours.named_modules() if m in lora_layers(ours)} == {"W_q", "W_v"}
    idx = _tokens()
    with torch.no_grad():
        assert (ours(idx)[0] - theirs(input_ids=idx).logits).abs().max() <= TOLERANCE


def test_a_bert_adapter_goes_both_ways_with_peft(tmp_path):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    transformers.BertModel(config).save_pretrained(tmp_path / "bert")
    ours = pf.add_lora(pf.load_hf_bert(tmp_path / "bert"), r=2, alpha=4.0, targets=("W_q", "W_v")).eval()
    _randomize_b(ours)
    save_lora(ours, tmp_path / "ours")
    theirs = _peft().PeftModel.from_pretrained(transformers.BertModel.from_pretrained(tmp_path / "bert").eval(),
                                            tmp_path / "ours").eval()
    theirs.save_pretrained(tmp_path / "theirs")
    again = load_lora(pf.load_hf_bert(tmp_path / "bert"), tmp_path / "theirs").eval()
    ids = torch.randint(1, 40, (2, 7), generator=torch.Generator().manual_seed(2))  # 0 is [PAD], masked by ours
    with torch.no_grad():
        reference = theirs(input_ids=ids).last_hidden_state
        assert (ours(ids).last_hidden_state - reference).abs().max() <= TOLERANCE
        assert (again(ids).last_hidden_state - reference).abs().max() <= TOLERANCE


def _gpt2_shaped() -> pf.GPT:
    torch.manual_seed(0)
    return pf.GPT(pf.GPTConfig(vocab_size=31, block_size=16, n_layers=2, n_heads=2, d_model=16, d_ff=32))


def test_a_gpt2_layout_model_is_saved_in_our_names_and_loads_back_exactly(tmp_path):
    ours = pf.add_lora(_gpt2_shaped(), r=2, targets=("W_q", "W_v")).eval()
    _randomize_b(ours)
    save_lora(ours, tmp_path / "adapter")
    from safetensors.torch import load_file
    assert "blocks.0.self_attn.W_q.lora_A" in load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    again = load_lora(_gpt2_shaped(), tmp_path / "adapter").eval()
    idx = _tokens()
    with torch.no_grad():
        assert torch.equal(ours(idx)[0], again(idx)[0])


def test_an_adapter_of_a_rotary_model_no_layout_expresses_is_saved_in_our_names(tmp_path):
    """value_residual has no Hugging Face form, so no PEFT base either: our names, loaded back exactly."""
    def model() -> pf.GPT:
        torch.manual_seed(0)
        return pf.GPT(pf.GPTConfig(vocab_size=31, block_size=16, n_layers=2, n_heads=4, d_model=16, d_ff=32,
                                   pos_encoding="rope", norm="rmsnorm", activation="swiglu", value_residual=True))

    ours = pf.add_lora(model(), r=2, targets=("W_q", "W_v")).eval()
    _randomize_b(ours)
    save_lora(ours, tmp_path / "adapter")
    from safetensors.torch import load_file
    assert "blocks.1.self_attn.W_v.lora_B" in load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    again = load_lora(model(), tmp_path / "adapter").eval()
    idx = _tokens()
    with torch.no_grad():
        assert torch.equal(ours(idx)[0], again(idx)[0])


def test_an_adapter_that_does_not_fit_the_model_is_refused_naming_the_file(tmp_path):
    ours = pf.add_lora(_gpt2_shaped(), r=2, targets=("W_q",))
    save_lora(ours, tmp_path / "adapter")
    wider = pf.GPT(pf.GPTConfig(vocab_size=31, block_size=16, n_layers=2, n_heads=2, d_model=32, d_ff=32))
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors: blocks\.\d\.self_attn\.W_q\.lora_A has shape"):
        load_lora(wider, tmp_path / "adapter")
    with pytest.raises(ValueError, match="no LoRA layers to save"):
        save_lora(_gpt2_shaped(), tmp_path / "none")


# ----------------------------------------------------------------------------- PEFT, with copied A and B

def _peft_model(hf_model, targets: list[str], r: int = 4, alpha: float = 8.0):
    config = _peft().LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets,
                             init_lora_weights=False)  # random A and B: the comparison cannot pass trivially
    return _peft().get_peft_model(hf_model, config).eval()


def _copy_adapters(theirs, ours, names: dict[str, str]) -> None:
    """Copy PEFT's A and B (`...{hf}.lora_A.default.weight`) into ours (`{ours}.lora_A`)."""
    state = theirs.state_dict()
    with torch.no_grad():
        for hf_module, our_module in names.items():
            layer = ours.get_submodule(our_module)
            layer.lora_A.copy_(state[f"base_model.model.{hf_module}.lora_A.default.weight"])
            layer.lora_B.copy_(state[f"base_model.model.{hf_module}.lora_B.default.weight"])


LLAMA_NAMES = {**{f"model.layers.{i}.self_attn.{hf}": f"blocks.{i}.self_attn.{w}"
                  for i in range(2) for hf, w in (("q_proj", "W_q"), ("v_proj", "W_v"))},
               **{f"model.layers.{i}.mlp.down_proj": f"blocks.{i}.ff.W_2" for i in range(2)}}


def test_a_llama_matches_peft_unmerged_merged_and_unmerged_again(tmp_path):
    directory = _llama_directory(tmp_path)
    ours = pf.load_hf(directory)
    theirs = _peft_model(_hf_llama(directory), ["q_proj", "v_proj", "down_proj"])
    pf.add_lora(ours, r=4, alpha=8.0, targets=("W_q", "W_v", "W_2")).eval()
    _copy_adapters(theirs, ours, LLAMA_NAMES)
    idx = _tokens()
    with torch.no_grad():
        reference = theirs(input_ids=idx).logits
        assert (ours(idx)[0] - reference).abs().max() <= TOLERANCE
        pf.merge_lora(ours)
        assert (ours(idx)[0] - reference).abs().max() <= TOLERANCE
        assert (ours(idx)[0] - theirs.merge_and_unload()(input_ids=idx).logits).abs().max() <= TOLERANCE
        pf.unmerge_lora(ours)
        assert (ours(idx)[0] - reference).abs().max() <= TOLERANCE


def test_a_bert_matches_peft_with_copied_adapters(tmp_path):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    hf = transformers.BertModel(config).eval()
    hf.save_pretrained(tmp_path / "bert")
    ours = pf.load_hf_bert(tmp_path / "bert")
    theirs = _peft_model(hf, ["query", "value"])
    pf.add_lora(ours, r=4, alpha=8.0, targets=("W_q", "W_v")).eval()
    names = {f"encoder.layer.{i}.attention.self.{hf}": f"layers.{i}.self_attn.{w}"
             for i in range(2) for hf, w in (("query", "W_q"), ("value", "W_v"))}
    _copy_adapters(theirs, ours, names)
    ids = torch.randint(1, 40, (2, 7), generator=torch.Generator().manual_seed(2))  # 0 is [PAD], masked by ours
    with torch.no_grad():
        reference = theirs(input_ids=ids).last_hidden_state
        assert (ours(ids).last_hidden_state - reference).abs().max() <= TOLERANCE
        pf.merge_lora(ours)
        assert (ours(ids).last_hidden_state - reference).abs().max() <= TOLERANCE


def test_a_bert_classifiers_adapter_is_peft_seq_cls_with_its_head_both_ways(tmp_path):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32, num_labels=3)
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "base")
    ours = pf.add_lora(pf.load_hf(tmp_path / "base"), r=2, alpha=4.0, targets=("W_q", "W_v"),
                       trainable=("classifier",)).eval()
    _randomize_b(ours)
    with torch.no_grad():
        ours.classifier.weight.normal_(generator=torch.Generator().manual_seed(5))  # a head trained away
    save_lora(ours, tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / ADAPTER_CONFIG).read_text())
    assert saved["task_type"] == "SEQ_CLS" and saved["modules_to_save"] == ["classifier"]
    base = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "base").eval()
    theirs = _peft().PeftModel.from_pretrained(base, tmp_path / "ours").eval()
    ids = torch.randint(1, 40, (2, 7), generator=torch.Generator().manual_seed(2))  # 0 is [PAD], masked by ours
    with torch.no_grad():
        reference = theirs(input_ids=ids).logits
        assert (ours(ids)[0] - reference).abs().max() <= TOLERANCE
    theirs.save_pretrained(tmp_path / "theirs")
    again = load_lora(pf.load_hf(tmp_path / "base"), tmp_path / "theirs").eval()
    with torch.no_grad():
        assert (again(ids)[0] - reference).abs().max() <= TOLERANCE
