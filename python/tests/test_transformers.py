# SPDX-License-Identifier: Apache-2.0
"""Hugging Face transformers through seqpar's registered attention (seqpar.integrations.transformers):
tiny random-weight Llama, Qwen3, gpt-oss (sinks, alternating sliding and full layers) and DeepSeek-V3
(MLA: 192/128 heads, YaRN's scale correction) on 2 and 4 gloo processes against the same weights with
attn_implementation="eager" on one process, each document alone (a document mask by construction),
float64: logits of every row, the loss (a supervised fine-tuning batch whose prompts are
masked with -100) and every parameter's gradient. gpt-oss's eager attention runs in float64 (1e-10);
Llama's, Qwen3's and DeepSeek-V3's take their softmax in float32 (1e-6 against eager), so they are also
checked against attn_implementation="sdpa", float64 throughout (1e-10)."""
import pytest

from dist_util import run

transformers = pytest.importorskip("transformers")

TOL = 1e-10
TOL_FP32_SOFTMAX = 1e-6  # eager attention's float32 softmax (2^-24 relative per probability)
# The one-process references of each model: (implementation, tolerance).
REFERENCES = {"llama": [("eager", TOL_FP32_SOFTMAX), ("sdpa", TOL)], "qwen3": [("eager", TOL_FP32_SOFTMAX), ("sdpa", TOL)],
              "gpt-oss": [("eager", TOL)], "deepseek-v3": [("eager", TOL_FP32_SOFTMAX), ("sdpa", TOL)]}


def _configs():
    from transformers import DeepseekV3Config, GptOssConfig, LlamaConfig, Qwen3Config

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=512, attention_dropout=0.0)
    return {
        "llama": LlamaConfig(**common, num_key_value_heads=2, head_dim=8),
        "qwen3": Qwen3Config(**common, num_key_value_heads=2, head_dim=8),
        "gpt-oss": GptOssConfig(**common, num_key_value_heads=2, head_dim=8, sliding_window=5,
                                layer_types=["sliding_attention", "full_attention"], num_local_experts=2,
                                num_experts_per_tok=1),
        "deepseek-v3": DeepseekV3Config(**common, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                        first_k_dense_replace=2, n_routed_experts=2, num_experts_per_tok=1,
                                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                         "original_max_position_embeddings": 128, "mscale": 1.0,
                                                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    }


def _batch():
    import torch

    lengths = [11, 1, 17, 3, 8, 2, 6]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (sum(lengths),), generator=gen)
    labels = ids.clone()
    labels[:4] = -100  # the first document's prompt
    labels[12:20] = -100  # the third's
    return lengths, ids, labels


def _eager(model, lengths, ids, labels):
    """One process, each document of the packed batch through the model alone (the document mask by
    construction: transformers' own packed-sequence masks, from position ids, do not separate documents
    inside a sliding window in this version); the mean loss over the labels that count, over the batch."""
    import torch
    import torch.nn.functional as F

    shifted = torch.full_like(labels, -100)
    shifted[:-1] = labels[1:]
    ends = torch.tensor(lengths).cumsum(0) - 1
    shifted[ends] = -100
    count = int((shifted != -100).sum())
    logits, loss = [], 0.0
    for doc_ids, doc_labels in zip(ids.split(lengths), shifted.split(lengths)):
        out = model(input_ids=doc_ids[None], use_cache=False).logits[0]
        part = F.cross_entropy(out, doc_labels, reduction="sum", ignore_index=-100) / count
        part.backward()
        logits.append(out.detach())
        loss = loss + part.detach()
    return torch.cat(logits), loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _models(rank, world, names, strategy):
    import copy

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import seqpar.integrations.transformers as sphf

    sphf.register()
    lengths, ids, labels = _batch()
    errors = {}
    configs = _configs()
    for name in names:
        config = configs[name]
        torch.manual_seed(0)
        # The experts' "eager" implementation (a loop of matmuls): grouped_mm has no float64. A config of
        # its own for each model: from_config sets the attention implementation on the config it is given.
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="seqpar",
                                                 dtype=torch.float64, experts_implementation="eager")
        for t in model.state_dict().values():  # one set of weights on every rank, as DDP would broadcast
            dist.broadcast(t, 0)
        refs = {}
        for impl, tol in REFERENCES[name]:
            ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl,
                                                   dtype=torch.float64, experts_implementation="eager")
            ref.load_state_dict(model.state_dict())
            refs[impl] = (_eager(ref, lengths, ids, labels), tol)

        layer = sphf.configure(model, strategy, ranks_per_node=2 if world == 4 else 0, timeout_s=60)
        local = sphf.shard(model, ids, lengths, labels=labels)
        logits = model(**local.model_inputs()).logits[0]
        loss = sphf.loss(logits, local)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            grads[n] = g
        err = {}
        for impl, ((logits_ref, loss_ref, grads_ref), tol) in refs.items():
            e = {"logits": (logits.detach() - logits_ref[local.rows]).abs().max().item(),
                 "loss": abs(total.item() - loss_ref.item())}
            for n, g in grads.items():
                want = grads_ref.get(n, torch.zeros_like(g))
                e[n] = ((g - want).abs().max() / want.abs().max().clamp(min=1.0)).item()
            err[impl] = (e, tol)
        errors[name] = {"errors": err, "mask_mix": layer._args["mask_mix"], "count": local.label_count,
                        "params": len(list(model.parameters())), "windows": [
                            getattr(m, "sliding_window", None) for m in model.modules() if hasattr(m, "seqpar_attention")]}
    return errors


@pytest.mark.parametrize("world,strategy", [(2, "zigzag-ring"), (4, "hybrid-aware")])
def test_models_match_eager(world, strategy):
    names = ["llama", "qwen3", "gpt-oss", "deepseek-v3"]
    for rank, results in enumerate(run(_models, world, names, strategy, timeout=400)):
        assert set(results) == set(names)
        for name, r in results.items():
            assert len(r["errors"]) == len(REFERENCES[name])
            for impl, (errors, tol) in r["errors"].items():
                bad = {k: e for k, e in errors.items() if not e < tol}
                assert not bad, f"rank {rank}, {name} ({strategy}) vs {impl}: above {tol}: {bad}"
                assert len(errors) == r["params"] + 2
        # 48 tokens, 7 documents: 41 next-token labels. The masks hide labels 1-3 (label 0 is a document's
        # first token, no token's target) and 13-19 (12 starts the third document).
        assert results["llama"]["count"] == 41 - 3 - 7
        assert results["gpt-oss"]["mask_mix"] == [((-1, 0), 1), ((4, 0), 1)]
        assert results["gpt-oss"]["windows"] == [5, None]
