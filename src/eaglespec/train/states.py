"""`eaglespec data states`: cache the target's features for offline training.

For every data shard, `states-NNNNN.safetensors` holds, per token (flattened like the shard): the
captured aux states `aux` [N, A*H] (bf16), and the target's top-k next-token probabilities `top_p`
[N, K] (fp16) with their ids `top_i` [N, K] (int32), sorted so top_i[:, 0] is the argmax. Storing all
V logits would take V*4 bytes a token (32 KB for V = 8K); top-k with K = 32 keeps the mass that matters
for a small draft vocabulary. Approximation (documented): offline targets renormalise the top-k mass
that falls inside the draft vocabulary, where online training uses the exact full distribution.
The size is estimated and free disk space checked before anything is written; finished files are
skipped on a rerun (resume).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .shards import DataError, load_shard, read_manifest, write_json_atomic
from .ttt import collate, target_features


def states_path(root: Path, index: int) -> Path:
    return root / f"states-{index:05d}.safetensors"


def estimate_bytes(num_tokens: int, aux_width: int, topk: int) -> int:
    return num_tokens * (aux_width * 2 + topk * (2 + 4))


def build_states(data_dir, out_dir, *, target, topk=32, batch_size=8, progress=True, part=(0, 1),
                 quantize: str | None = None, quantize_group: int | None = None) -> dict:  # fmt: skip
    """Cache aux states and top-k target probabilities per data shard; part (I, N): shards I, I + N, ...
    only, so N machines sharing `out_dir` split the work (each shard is its own file)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from .regen import target_fingerprint

    data_dir, out = Path(data_dir), Path(out_dir)
    man = read_manifest(data_dir)
    from ..models.checkpoint import load_target

    if man.get("target_fingerprint") not in (None, target_fingerprint(target)):
        raise DataError(f"{data_dir} was generated for another target; regenerate it with {target}")
    from ..models.quantize import apply_quantize

    tgt = apply_quantize(load_target(target), quantize, quantize_group)
    aux_width = tgt.cfg.hidden_size * len(tgt.aux_layers)
    if not 1 <= topk <= tgt.cfg.vocab_size:
        raise ValueError(f"topk must be in [1, {tgt.cfg.vocab_size}], got {topk}")
    todo = [i for i in range(man["num_shards"]) if i % part[1] == part[0] and not states_path(out, i).is_file()]
    shards = {i: load_shard(data_dir, i) for i in todo}
    need = estimate_bytes(sum(len(s.input_ids) for ss in shards.values() for s in ss), aux_width, topk)
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if need * 1.1 > free:
        gib = lambda n: f"{n / 2**30:.2f} GiB"
        raise DataError(f"the state cache needs about {gib(need)} but {out} has {gib(free)} free; "
                        "free space, lower --topk, or train online (without --states)")  # fmt: skip
    write_json_atomic({"data": str(data_dir), "topk": topk, "aux_layers": list(tgt.aux_layers), "quantize": quantize,
                       "aux_width": aux_width, "num_shards": man["num_shards"],
                       "estimated_bytes": need}, out / "states.json")  # fmt: skip
    bar = tqdm(total=sum(len(v) for v in shards.values()), unit="sample", disable=not progress, desc="states")
    for i, samples in shards.items():
        aux_parts, p_parts, i_parts = [], [], []
        for j in range(0, len(samples), batch_size):
            chunk = samples[j : j + batch_size]
            batch = collate(chunk)
            aux, logits = target_features(tgt, batch)
            top = logits.float().softmax(-1).topk(topk, dim=-1)
            for r, n in enumerate(batch.lengths.tolist()):
                aux_parts.append(aux[r, :n].to(torch.bfloat16).cpu())
                p_parts.append(top.values[r, :n].to(torch.float16).cpu())
                i_parts.append(top.indices[r, :n].to(torch.int32).cpu())
            bar.update(len(chunk))
        tensors = {"aux": torch.cat(aux_parts), "top_p": torch.cat(p_parts), "top_i": torch.cat(i_parts)}
        path = states_path(out, i)
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    bar.close()
    return {"bytes": need, "shards_written": len(todo)}


def load_states(states_dir, samples, aux_width: int) -> list[dict]:
    """Per sample {aux, top_p, top_i}, aligned with `samples` (load_samples of the same data directory):
    each states file holds the tokens of consecutive samples, so files are matched by token counts."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    states_dir = Path(states_dir)
    meta = states_dir / "states.json"
    if not meta.is_file():
        raise DataError(f"{states_dir} has no states.json; create it with `eaglespec data states`")
    out: list[dict] = []
    for i in range(json.loads(meta.read_text())["num_shards"]):
        path = states_path(states_dir, i)
        if not path.is_file():
            raise DataError(f"{states_dir} lacks {path.name}; rerun `eaglespec data states` to finish it")
        try:
            t = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise DataError(f"{path} is not readable ({e}); delete it and rerun `eaglespec data states`") from None
        n, a = t["aux"].shape[0], 0
        while a < n and len(out) < len(samples):
            b = a + len(samples[len(out)].input_ids)
            out.append({"aux": t["aux"][a:b], "top_p": t["top_p"][a:b], "top_i": t["top_i"][a:b]})
            a = b
        if a != n or t["aux"].shape[1] != aux_width:
            raise DataError(f"{path} does not match the data (token count or aux width differ: was it made for "
                            "this data and target?); delete it and rerun `eaglespec data states`")  # fmt: skip
    if len(out) != len(samples):
        raise DataError(f"{states_dir} covers {len(out)} of {len(samples)} samples; rerun `eaglespec data states`")
    return out
