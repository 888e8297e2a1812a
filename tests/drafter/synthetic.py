"""A tiny Llama-shaped target and synthetic hidden states for it, learnable by a drafter: what the drafter's tests
train on (``data``, tests/drafter/conftest.py)."""

import json

import torch
from safetensors.torch import save_file

from eaglepipe.dataset import shards
from eaglepipe.hidden import layout

V, H, LAYERS = 512, 64, 8


def tiny_target(folder):
    """A Llama-shaped target folder with just what train reads: config, tied embedding, final norm, layer L-3."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": LAYERS,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "hidden_act": "silu",
        "vocab_size": V,
        "tie_word_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(V, H, generator=g)
    shapes = {
        "self_attn.q_proj.weight": (64, H),
        "self_attn.k_proj.weight": (32, H),
        "self_attn.v_proj.weight": (32, H),
        "self_attn.o_proj.weight": (H, 64),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (128, H),
        "mlp.up_proj.weight": (128, H),
        "mlp.down_proj.weight": (H, 128),
    }
    layer = {
        f"model.layers.{LAYERS - 3}.{k}": torch.randn(*s, generator=g) * 0.05 + (len(s) == 1)  # norms near 1
        for k, s in shapes.items()
    }
    save_file(
        {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(H), **layer},
        str(folder / "model.safetensors"),
    )
    return embed


def synthetic_hidden(folder, head, n_train=24, n_valid=4, seed=1, min_output=4):
    """Sequences that follow a fixed bigram map (learnable), in the layout of data/hidden: the target's final state
    at t points at the next token (its argmax is x[t+1]), aux is noise plus the embedding of x[t], top is the argmax
    of the unrounded final state."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    succ = torch.randperm(V - 3, generator=g)[:200] + 3  # 200 tokens in a cycle
    nxt = {int(a): int(b) for a, b in zip(succ, succ.roll(-1))}
    index = {
        "layers": [2, LAYERS // 2, LAYERS - 3],
        "layer_convention": layout.LAYER_CONVENTION,
        "hidden_size": H,
        "dtype": "bfloat16",
    }
    for split, n in (("train", n_train), ("valid", n_valid)):
        ids, masks, offsets = [], [], [0]
        for _ in range(n):
            prompt = int(torch.randint(3, 10, (1,), generator=g))
            output = int(torch.randint(min_output, 16, (1,), generator=g))
            seq = [int(succ[torch.randint(0, 200, (1,), generator=g)])]
            for _ in range(prompt + output - 1):
                seq.append(nxt[seq[-1]])
            ids += seq
            masks += [0] * prompt + [1] * output
            offsets.append(len(ids))
        x = torch.tensor(ids)
        final = torch.cat((head[x[1:]], torch.randn(1, H, generator=g))) * 0.5
        aux = torch.cat([head[x] + torch.randn(len(ids), H, generator=g) for _ in range(3)], -1)
        file = f"{split}-00000.safetensors"
        shards.write(
            folder / file,
            {
                "input_ids": x.int(),
                "loss_mask": torch.tensor(masks, dtype=torch.uint8),
                "offsets": torch.tensor(offsets),
                "aux": aux.bfloat16(),
                "final": final.bfloat16(),
                "top": (final @ head.T).argmax(-1).int(),
            },
        )
        index[split] = {
            "shards": [{"file": file, "samples": n, "tokens": len(ids), "ids": [f"{split}{i}" for i in range(n)]}],
            "samples": n,
            "tokens": len(ids),
        }
    (folder / "index.json").write_text(json.dumps(index))
