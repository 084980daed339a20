"""Tiny hybrid models written at test time: a config, a word-piece tokenizer built here from an
embedded corpus, and seeded random weights. No hub access.

Kinds (`write_tiny_model(kind, out_dir)`):
- `gated-delta`: Qwen3-Next (3 gated-delta-net layers, 1 gated attention layer, 4 MoE experts);
- `mamba2`: Nemotron-H (2 Mamba2 layers, 1 attention layer, 1 MLP), in the legacy config keys
  (`hybrid_override_pattern`, `mamba_n_groups`) SGLang 0.5.23's config class reads;
- `dense`: Llama (attention only), for the "no SSM layers, upstream's cache" path;
- `gated-delta-mtp`: `gated-delta` with Qwen3-Next's MTP module (`mtp.*`: the draft layer that
  `--speculative-algorithm NEXTN` serves). A random draft layer would almost never guess the
  target's next token, so both are built to agree about half the time: every layer's output
  projection is scaled by `MTP_LAYER_SCALE`, which leaves the target's greedy choice mostly a
  function of the last token (logits ~ lm_head(norm(embed(token)))), and the MTP layer's `fc`
  passes the next token's normed embedding through, so its prediction is that same function of
  the token it is given. The layers still move every logit (a prefix hit must restore their
  states exactly), and drafts are both accepted and rejected (measured: about half);
- `sliding-window`: Mellum (Qwen3-MoE family with interleaved sliding-window / full attention: 3
  sliding-window layers with a `SLIDING_WINDOW`-token window, 1 global layer), one of the SWA
  hybrids SGLang serves through its SWA cache component (no SSM layers). Dense MLPs only: with
  MoE layers, SGLang's CPU MoE path gives results that depend on how many tokens share the
  forward, so a prefix hit moved output logprobs by up to 0.005 with any cache (measured).

Why whole words: a random model emits arbitrary token sequences. With byte-level BPE those decode
to broken UTF-8 and re-tokenise differently, so text-based clients (SGLang frontend programs)
could never hit the cache on a previous turn's output. Here the model only ever emits whole words
(the output rows of special tokens and `##` continuation pieces are zeroed: greedy decoding never
picks them, nor ends early), `decode` joins words with spaces, and decode -> encode round-trips
exactly. Any other ASCII text (a benchmark's numbers, say) still tokenises, into characters and
continuation pieces. Weights use a large init range so different prompts give different greedy
outputs.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<unk>")
EOS = "<|endoftext|>"
KINDS = ("gated-delta", "mamba2", "dense", "sliding-window", "gated-delta-mtp")
# Small enough that a few hundred tokens of prompt cross it many times (the SWA tests need hits
# whose window is partly evicted, and prompts longer than the window).
SLIDING_WINDOW = 32
# gated-delta-mtp: the layers' share of the residual stream (see the module docstring). At 1/300
# (0.003) the target's greedy token equals the embedding-only guess about half the time
# (HF transformers, float32: 0.01 -> 14%, 0.003 -> 53%, 0.001 -> 84%).
MTP_LAYER_SCALE = 0.003
_OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "down_proj")
# Directory names: neutral, so SGLang's frontend picks its "default" chat template
# (SYSTEM: / USER: / ASSISTANT:) rather than one keyed on a model family in the path.
DIR_NAMES = {"gated-delta": "tiny-gated-delta-hybrid", "mamba2": "tiny-mamba2-hybrid", "dense": "tiny-dense",
             "sliding-window": "tiny-sliding-window-hybrid", "gated-delta-mtp": "tiny-gated-delta-mtp-hybrid"}

_CORPUS = """
SYSTEM USER ASSISTANT : , . ? ! ; ( ) - + = / * # 0 1 2 3 4 5 6 7 8 9 10 11 12 16 20 32 64 100 128 256 512 1000
you are a helpful assistant for a team that builds serving systems answer every question with care and keep
replies short when the user asks for code write it in python and explain each step the cache keeps the state of
shared prefixes so that later requests skip their prefill a hybrid model mixes attention layers with state space
layers whose recurrent state is updated in place and cannot be rolled back so a hit needs a checkpoint at exactly
the matched position prefix caching eviction admission policy memory tokens blocks pages slots layers heads model
request response prompt system user agent tool call result file line function class test error value list map
set key index tree node leaf branch root parent child path search match insert delete update read write open
close start stop run build check find fix add remove move copy save load send receive wait retry fail pass good
bad fast slow small large new old first last next previous early late high low long short hot cold warm free busy
one two three four five six seven eight nine ten hundred thousand many few all none some each every other same
different and or not but if then else while for in on at by with from to of into over under about after before
is are was were be been being have has had do does did can could will would should may might must shall
this that these those it its they them their we our us he she his her i me my your yours what which who whom
why how where when here there now today tomorrow yesterday always never often sometimes again once twice
data trace workload benchmark hit rate latency throughput time first token decode prefill batch queue server
client network port host process thread worker scheduler allocator pool kernel tensor vector matrix weight
score alpha recency efficiency flops bytes capacity budget ratio grid chunk split two pass speculative
hello world the quick brown fox jumps over lazy dog please thanks sure okay yes no maybe done
plan step goal task issue note report table plot figure chart summary detail reason cause effect fix
read write list run grep edit commit diff patch review merge deploy rollback
code python rust numpy torch triton sglang marconi mamba attention linear gated delta net expert router
""".split()


def _tokenizer_vocab() -> dict[str, int]:
    """Special tokens, every printable ASCII character, continuation pieces (`##x`) for lowercase
    letters and digits, then the corpus words, then filler words up to VOCAB_SIZE."""
    chars = string.ascii_lowercase + string.digits + string.ascii_uppercase + string.punctuation
    entries = [*SPECIAL_TOKENS, *chars, *(f"##{c}" for c in string.ascii_lowercase + string.digits)]
    # Only words that pre-tokenise whole (BERT splits at punctuation, `_` included).
    entries += [w for w in dict.fromkeys(_CORPUS) if w.isalnum() and w not in entries]
    entries += (f"w{i}" for i in range(VOCAB_SIZE - len(entries)))
    if len(entries) != VOCAB_SIZE:
        raise ValueError(f"tiny vocabulary has {len(entries)} entries, expected {VOCAB_SIZE}")
    return {token: i for i, token in enumerate(entries)}


def _build_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(_tokenizer_vocab(), unk_token="<unk>", max_input_chars_per_word=64))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, unk_token="<unk>", pad_token=EOS,
                                   model_max_length=131072, clean_up_tokenization_spaces=False)
    # A chat template for /v1/chat/completions, in the same role words as the frontend's default.
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    )
    fast.save_pretrained(out_dir)
    return fast


def never_generated(tokenizer) -> list[int]:
    """Ids whose output row is zeroed: special tokens, and continuation pieces, whose text would
    join the word before them and so not re-tokenise to the same ids."""
    return [i for token, i in tokenizer.get_vocab().items() if token in SPECIAL_TOKENS or token.startswith("##")]


def _hf_config(kind: str, eos_id: int) -> dict:
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, max_position_embeddings=131072, bos_token_id=eos_id,
                  eos_token_id=eos_id, pad_token_id=eos_id, tie_word_embeddings=False, torch_dtype="bfloat16",
                  initializer_range=0.5, rms_norm_eps=1e-6)
    if kind in ("gated-delta", "gated-delta-mtp"):
        return dict(common, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", intermediate_size=128,
                    num_hidden_layers=4, full_attention_interval=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, partial_rotary_factor=0.5, hidden_act="silu", rope_theta=10000.0,
                    attention_bias=False, attention_dropout=0.0, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                    decoder_sparse_step=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                    num_experts_per_tok=2, num_experts=4, norm_topk_prob=True, mlp_only_layers=[])
    if kind == "mamba2":
        return dict(common, architectures=["NemotronHForCausalLM"], model_type="nemotron_h", intermediate_size=128,
                    num_hidden_layers=4, hybrid_override_pattern="MM*-", num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, attention_bias=False, attention_dropout=0.0,
                    mamba_num_heads=8, mamba_head_dim=16, n_groups=2, mamba_n_groups=2, ssm_state_size=16,
                    conv_kernel=4, expand=2, chunk_size=64, mamba_hidden_act="silu", mamba_proj_bias=False,
                    use_conv_bias=True, use_bias=False, mlp_bias=False, mlp_hidden_act="relu2",
                    layer_norm_epsilon=1e-5, residual_in_fp32=False, rescale_prenorm_residual=True,
                    time_step_limit=[0.0, 1e30], time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4,
                    mamba_ssm_cache_dtype="float32", num_nextn_predict_layers=0)
    if kind == "dense":
        return dict(common, architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    hidden_act="silu", rope_theta=10000.0, attention_bias=False, mlp_bias=False)
    if kind == "sliding-window":
        layer_types = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
        return dict(common, architectures=["MellumForCausalLM"], model_type="mellum", intermediate_size=128,
                    num_hidden_layers=len(layer_types), layer_types=layer_types,
                    mlp_layer_types=["dense"] * len(layer_types), sliding_window=SLIDING_WINDOW,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
                    attention_bias=False, attention_dropout=0.0, moe_intermediate_size=32, num_experts=4,
                    num_experts_per_tok=2, norm_topk_prob=True,
                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    raise ValueError(f"unknown tiny model kind {kind!r}; choose from {', '.join(KINDS)}")


def _transformers_config(kind: str, config: dict):
    """transformers' own config class for the weights (Nemotron-H: its new layer-list layout)."""
    from transformers import AutoConfig

    if kind == "mamba2":
        from transformers import NemotronHConfig

        names = {"M": "mamba", "*": "attention", "-": "mlp"}
        kwargs = {k: v for k, v in config.items() if k not in ("hybrid_override_pattern", "mamba_n_groups",
                                                               "architectures", "model_type", "torch_dtype")}
        kwargs["layers_block_type"] = [names[c] for c in config["hybrid_override_pattern"]]
        return NemotronHConfig(**kwargs)
    return AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})


def _scale_layer_outputs(model) -> None:
    """Scale every decoder layer's output projections by MTP_LAYER_SCALE (in place)."""
    for name, param in model.named_parameters():
        if any(part in name for part in _OUTPUT_PROJECTIONS):
            param.mul_(MTP_LAYER_SCALE)


def _add_mtp_layer(out_dir: Path, config: dict, seed: int) -> None:
    """Qwen3-Next's MTP module, in its checkpoint names (`mtp.*`, what SGLang's
    `Qwen3NextForCausalLMMTP` loads for `--speculative-algorithm NEXTN`): `fc` over the normed
    next-token embedding and target hidden state, one gated-attention + MoE decoder layer, a final
    norm; embeddings and LM head are the target's."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed + 1)
    one_layer = dict(config, num_hidden_layers=1, full_attention_interval=1)
    layer = AutoModelForCausalLM.from_config(_transformers_config("gated-delta", one_layer), dtype=torch.bfloat16)
    with torch.no_grad():
        _scale_layer_outputs(layer)
    weights_path = out_dir / "model.safetensors"
    weights = load_file(weights_path)
    for name, tensor in layer.state_dict().items():
        if not (name.startswith("model.layers.0.") or name == "model.norm.weight"):
            continue
        name = "mtp." + name.removeprefix("model.")
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers' fused experts -> checkpoint names
            base, half = name.removesuffix("gate_up_proj"), tensor.shape[1] // 2
            for e, fused in enumerate(tensor):
                weights[f"{base}{e}.gate_proj.weight"] = fused[:half].contiguous()
                weights[f"{base}{e}.up_proj.weight"] = fused[half:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e, down in enumerate(tensor):
                weights[f"{base}{e}.down_proj.weight"] = down.contiguous()
        else:
            weights[name] = tensor.contiguous()
    hidden = config["hidden_size"]
    # fc(cat(normed next-token embedding, normed target hidden)) = the embedding: the draft guesses
    # what the target's near-bigram head would say after that token.
    weights["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1).to(torch.bfloat16)
    weights["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)  # Gemma norm: 1 + w
    weights["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)
    save_file(weights, weights_path, metadata={"format": "pt"})


def write_tiny_model(kind: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny random model of `kind` into `out_dir` (created) and return it."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(out_dir)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config = _hf_config(kind, eos_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_transformers_config(kind, config), dtype=torch.bfloat16)
    with torch.no_grad():  # logit 0: never the argmax among hundreds of random ones
        model.lm_head.weight[never_generated(tokenizer)] = 0
        if kind == "gated-delta-mtp":
            _scale_layer_outputs(model)
    model.save_pretrained(out_dir)  # the checkpoint layout (transformers fuses MoE experts in memory)
    if kind == "gated-delta-mtp":
        _add_mtp_layer(out_dir, config, seed)
    # Our own config (not transformers' rewrite): SGLang reads keys transformers 5 drops or renames.
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, "bos_token_id": eos_id}))
    return out_dir


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random hybrid model (tests, CPU demos).")
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_model(args.kind, args.out_dir, args.seed))
