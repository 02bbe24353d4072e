"""The same run from Python, with the rewards as callables and the rows as a list (any sequence
of mappings works: a Hugging Face `datasets.Dataset`, a Grain MapDataset).

    python examples/custom_reward/train.py /path/to/Qwen2.5-0.5B-Instruct [key=value ...]
"""

import json
import sys
from pathlib import Path

from jaxrl.api import CustomTask, train
from jaxrl.models.tokenizer import HFTokenizer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from rewards import correct, short  # noqa: E402


def main(model: str, *overrides: str) -> dict:
    rows = [json.loads(line) for line in (HERE / "prompts.jsonl").read_text().splitlines()]
    task = CustomTask.from_rows(rows, [correct, short], held_out=10,
                                tokenizer=HFTokenizer(model))   # writes the chat prompts
    return train(HERE / "config.yaml", [f"hf_path={model}", *overrides], task=task)


if __name__ == "__main__":
    print(main(*sys.argv[1:]))
