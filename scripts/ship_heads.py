"""Copy trained draft heads into the package as fp16 (what `--method eagle2|hass` use out of the box).

    python scripts/ship_heads.py [MODEL] [METHOD ...]   # default: smollm2-135m-instruct eagle2 hass

Reads each head where its recipe writes it ($SELFSPEC_HOME/heads/MODEL-eagle2 from
scripts/train_eagle2.sh, $SELFSPEC_HOME/long/MODEL-hass from scripts/train_hass_long.sh) and writes
src/selfspec/data/heads/MODEL-{eagle2,hass} (model.safetensors in fp16, config.json, selfspec_head.json
with a "shipped" note). A user's own trained head in $SELFSPEC_HOME/heads takes precedence over the
shipped one.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from selfspec.heads import HEAD_RECIPES, default_head_dir
from selfspec.paths import selfspec_home

LIMIT = 10 * 2**20  # bytes per committed artefact


def recipe_output(model: str, method: str) -> Path:
    """Where the method's recipe script leaves its finished head."""
    if method == "hass":
        return selfspec_home() / "long" / f"{model}-hass"
    return default_head_dir(model, method)


def main(model: str, methods: list[str]) -> None:
    for method in methods:
        src = recipe_output(model, method)
        if not (src / "selfspec_head.json").is_file():
            raise SystemExit(f"no trained {method} head in {src}; run bash {HEAD_RECIPES[method]} to the end first")
        dst = Path("src/selfspec/data/heads") / f"{model}-{method}"
        dst.mkdir(parents=True, exist_ok=True)
        state = {k: (v.half() if v.is_floating_point() else v).contiguous()  # d2t / t2d maps keep their dtypes
                 for k, v in load_file(str(src / "model.safetensors")).items()}
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(src / "config.json", dst / "config.json")
        meta = json.loads((src / "selfspec_head.json").read_text())
        meta["shipped"] = {"dtype": "float16", "from": f"$SELFSPEC_HOME/{src.parent.name}/{src.name}"}
        (dst / "selfspec_head.json").write_text(json.dumps(meta, indent=2) + "\n")
        size = (dst / "model.safetensors").stat().st_size
        if size > LIMIT:
            raise SystemExit(f"{dst} is {size / 2**20:.1f} MB, over the 10 MB limit for committed artefacts")
        print(f"{dst}: {size / 2**20:.1f} MB")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct", sys.argv[2:] or ["eagle2", "hass"])
