# SPDX-License-Identifier: Apache-2.0
# The README's "hf-drop-in" recipe, run as written on 2 gloo processes by test_readme_recipes.py; around it,
# a tiny gpt-oss config (sinks, a sliding and a full layer) and the one-process reference: the same model
# with attn_implementation="eager", each document alone (float64).
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM, GptOssConfig

torch.set_default_dtype(torch.float64)
config = GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=5,
                      layer_types=["sliding_attention", "full_attention"], num_local_experts=2, num_experts_per_tok=1,
                      attention_dropout=0.0, experts_implementation="eager", dtype=torch.float64)
lengths = [11, 1, 17, 3, 8, 2, 6]
input_ids = torch.randint(0, 64, (sum(lengths),), generator=torch.Generator().manual_seed(3))
labels = input_ids.clone()
labels[:4] = -100  # a masked prompt
cp_group = dist.group.WORLD
torch.manual_seed(0)
eager_model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
config = copy.deepcopy(config)
# BEGIN README: hf-drop-in
import seqpar.integrations.transformers as sphf
import seqpar.torch as spt

sphf.register()                                              # attn_implementation="seqpar"
model = AutoModelForCausalLM.from_config(config, attn_implementation="seqpar")
sphf.configure(model, "hybrid-aware", group=cp_group)        # head sizes and windows from the config
ddp = DistributedDataParallel(model)
local = sphf.shard(model, input_ids, lengths, labels=labels) # this rank's ids, positions, labels
loss = sphf.loss(ddp(**local.model_inputs()).logits, local)  # its share of the batch's mean loss
(loss * spt.data_parallel_loss_scale(cp_group)).backward()   # DDP averages over the ranks
# END README

eager_model.load_state_dict(model.state_dict())
target = torch.full_like(labels, -100)
target[:-1] = labels[1:]
target[torch.tensor(lengths).cumsum(0) - 1] = -100
count = int((target != -100).sum())
for ids, t in zip(input_ids.split(lengths), target.split(lengths)):
    logits = eager_model(input_ids=ids[None], use_cache=False).logits[0]
    (F.cross_entropy(logits, t, reduction="sum") / count).backward()
grads = {n: p.grad for n, p in eager_model.named_parameters()}
result = {n: ((p.grad - grads[n]).abs().max() / grads[n].abs().max().clamp(min=1.0)).item()
          for n, p in model.named_parameters()}
