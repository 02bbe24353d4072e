"""`jaxrl export`: a checkpoint as a Hugging Face folder (`merged`: adapters folded into the
base, or a model without adapters as it is) or as a Hugging Face base folder plus a PEFT
LoRA adapter folder (`peft`: OUT/base and OUT/adapter, jaxrl/models/peft_io.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from jaxrl.errors import UserError
from jaxrl.models import abstract_model, lora, merge_params, quant, split_params, to_hf
from jaxrl.models.lora import LoraConfig
from jaxrl.models.peft_io import merged, write_adapter

FORMATS = ("merged", "peft")


def export(checkpoint: str | Path, out: str | Path, fmt: str = "merged",
           step: int | None = None, log: Callable[[str], None] = print) -> Path:
    """Writes the checkpoint's model (its newest step, or `step`) to `out` in format `fmt`;
    returns `out`. UserError for a format without what it needs."""
    from jaxrl.trainer.warmup import restore_for_eval

    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: choose {' or '.join(FORMATS)}")
    model, _, _, step, cfg = restore_for_eval(checkpoint, step, with_config=True)
    model_cfg = model.cfg
    _, params = split_params(model)
    base_graph, _ = split_params(abstract_model(dataclasses.replace(
        model_cfg, lora=LoraConfig(), quantize="none")))
    out = Path(out)
    if fmt == "merged":
        weights = merged(params, model_cfg) if model_cfg.lora.enabled else \
            quant.dequantized(params, model_cfg)
        to_hf(merge_params(base_graph, weights), out)
        log(f"wrote {out} (Hugging Face, step {step}"
            + (", adapters merged)" if model_cfg.lora.enabled else ")"))
        return out
    if not model_cfg.lora.enabled:
        raise UserError(f"the checkpoint in {str(checkpoint)!r} (step {step}) has no LoRA "
                        f"adapters (model.lora.rank=0): export it with --format merged")
    to_hf(merge_params(base_graph, quant.dequantized(lora.frozen(params), model_cfg)),
          out / "base")
    # An int8 base's adapters were trained on its dequantized weights, OUT/base's: name it.
    own_base = cfg.hf_path is None or quant.enabled(model_cfg)
    base_name = str((out / "base").resolve()) if own_base else cfg.hf_path
    write_adapter(params, model_cfg, out / "adapter", base_name)
    log(f"wrote {out}/base (Hugging Face) and {out}/adapter (PEFT LoRA, r={model_cfg.lora.rank},"
        f" base {base_name}), step {step}")
    return out
