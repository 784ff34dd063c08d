"""Runs inside the speculators environment (scripts/interop/build_envs.sh) as a script; never imports eaglespec.

Loads an exported drafter with speculators' own loader (`Eagle3DraftModel.from_pretrained`) and runs its
own forward (training-time test, `ttt_steps` steps) on the inputs in INPUTS (safetensors: hidden_states
[1, T, 3H], input_ids [1, T], position_ids [1, T]); writes each step's draft logits (captured at lm_head)
and the loaded tensors to OUT, plus versions to OUT.json.

usage: python speculators_forward.py DRAFTER_DIR INPUTS OUT TTT_STEPS
"""

import importlib.metadata
import json
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.models.eagle3.core import Eagle3DraftModel


def main(drafter_dir: str, inputs: str, out: str, steps: int) -> None:
    config = Eagle3SpeculatorConfig.from_pretrained(drafter_dir)
    config.transformer_layer_config._attn_implementation = "eager"  # dense masks on CPU
    model = Eagle3DraftModel.from_pretrained(drafter_dir, config=config).float().eval()
    x = load_file(inputs)
    logits = []
    model.lm_head.register_forward_hook(lambda _m, _i, o: logits.append(o.detach().clone()))
    with torch.no_grad():
        model(hidden_states=x["hidden_states"], input_ids=x["input_ids"], position_ids=x["position_ids"],
              document_ids=torch.zeros_like(x["input_ids"]), ttt_steps=steps)
    result = {f"logits.{k}": v.contiguous() for k, v in enumerate(logits)}
    result.update({f"loaded.{k}": v.contiguous() for k, v in model.state_dict().items()
                   if not k.startswith("verifier_")})
    save_file(result, out)
    flags = {k: getattr(model.config, k) for k in ("fc_norm", "norm_output", "norm_before_residual",
                                                     "norm_before_fc", "eagle_aux_hidden_state_layer_ids")}
    info = {"speculators": importlib.metadata.version("speculators"),
            "transformers": transformers.__version__, "torch": torch.__version__, "flags": flags,
            "class": type(model).__name__}
    with open(out + ".json", "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
