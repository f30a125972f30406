"""GPU checks of sequence / context parallelism on packed rows that the CPU machine cannot run (NCCL, 2 GPUs).

Launched by ``benchmarks/gpu/run.sh`` (``ONLY=spcp``) as
``torchrun --nproc_per_node 2 sp_cp_checks.py MODE OUT``; writes one JSON line per check to ``OUT``. Written
for the GPU machine and NOT yet run (the machine lent so far has one GPU; these need two):

- ``torch-cp``: torch's ``context_parallel`` (what accelerate's ``ParallelismConfig(cp_size=2)`` hook wraps
  around SDPA) on a packed row laid out for CP (each document padded to 2 x cp): the logits of every
  document against the document alone. padfree refuses ``cp_size`` on packed rows because the hook forces
  one causal mask over the row; this records the leak (or the error) that the refusal prevents.
- ``alst``: DeepSpeed ALST (Ulysses SP, the backend of ``ParallelismConfig(sp_size=2)``) on the same packed
  row with ``position_ids`` restarting per document, when ``deepspeed`` is importable: does each document
  still see only itself? (the GPU check behind PadfreeTrainer refusing ``sp_size`` here).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from padfree.models import build_model
from padfree.torch import PackCollator

DOCS = (37, 90, 5, 64)


def _row(vocab: int, sp: int = 1, cp: int = 1) -> tuple[list[torch.Tensor], dict]:
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, vocab, (n,), generator=gen) for n in DOCS]
    return docs, PackCollator(sp=sp, cp=cp)([{"input_ids": d.numpy()} for d in docs])


def _worst(logits: torch.Tensor, row: dict, alone: list[torch.Tensor]) -> float:
    cu = row["cu_seq_lens_q_padded"] if "cu_seq_lens_q_padded" in row else row["cu_seq_lens_q"]
    return max(
        (logits[int(cu[i]) : int(cu[i]) + len(a)].float() - a.float()).abs().max().item()
        for i, a in enumerate(alone)
    )


def torch_cp(out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    net = build_model("tiny-llama", attn_implementation="sdpa").cuda().eval()
    docs, row = _row(net.config.vocab_size, cp=world)
    ids, pos = row["input_ids"].cuda(), row["position_ids"].cuda()
    with torch.no_grad():
        alone = [net(input_ids=d[None].cuda()).logits[0] for d in docs]
        try:
            with context_parallel(mesh, buffers=[ids, pos], buffer_seq_dims=[1, 1]):
                logits = net(input_ids=ids, position_ids=pos).logits
            (full,) = context_parallel_unshard(mesh, [logits], [1])
        except Exception as exc:  # what accelerate's hook would meet on a packed row
            return {
                "check": "torch context_parallel on a packed row",
                "error": f"{type(exc).__name__}: {exc}",
            }
    diff = _worst(full[0], row, alone)
    return {"check": "torch context_parallel on a packed row", "alone_diff": diff, "leaked": diff > 1e-2}


def alst(out: str) -> dict:
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    except Exception as exc:
        return {"check": "DeepSpeed ALST", "skipped": f"deepspeed not importable ({type(exc).__name__})"}
    world = dist.get_world_size()
    net = build_model("tiny-llama", attn_implementation="sdpa")
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=net,
        core_attn_implementation="sdpa",
        sequence_parallel_size=world,
        micro_batch_size=1,
        seq_length=None,
        seq_length_is_variable=True,
    )
    net = net.cuda().eval()
    docs, row = _row(net.config.vocab_size, sp=world)  # the row padded to a multiple of sp
    total = row["input_ids"].shape[1]
    ids, pos = row["input_ids"].cuda(), row["position_ids"].cuda()
    rank, n = dist.get_rank(), total // world
    with torch.no_grad():
        alone = [net(input_ids=d[None].cuda()).logits[0] for d in docs]
        shard = net(
            input_ids=ids[:, rank * n : (rank + 1) * n], position_ids=pos[:, rank * n : (rank + 1) * n]
        )
        pieces = [torch.empty_like(shard.logits[0]) for _ in range(world)]
        dist.all_gather(pieces, shard.logits[0].contiguous(), group=mpu.get_sequence_parallel_group())
    diff = _worst(torch.cat(pieces), row, alone)
    return {"check": "DeepSpeed ALST on a packed row (position_ids per document)", "alone_diff": diff}


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    result = {"torch-cp": torch_cp, "alst": alst}[mode](out)
    if dist.get_rank() == 0:
        print(json.dumps(result))
        with open(out, "a") as f:
            f.write(json.dumps(result) + "\n")
    dist.destroy_process_group()
