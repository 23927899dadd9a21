"""What OpenRLHF sends the remote reward model, against a running `kforge up` (CPU backend).

kforge up &  python examples/trainers/openrlhf/wiring.py
"""

import json
import urllib.request
from pathlib import Path

from kforge.adapters import AdapterConfig, answer_text
from kforge.adapters.openrlhf import RewardServer

TASK = Path(__file__).resolve().parents[2] / "tasks" / "relu"
PROMPT = "<|im_start|>user\nWrite ModelNew.<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    """Runs the example."""
    kernel = next((TASK / "candidates").glob("*.py")).read_text()
    with RewardServer(AdapterConfig.from_env(backend="cpu")) as server:  # python -m kforge.adapters.openrlhf
        body = {
            "query": [PROMPT + answer_text(kernel)],
            "prompts": [PROMPT],
            "labels": [(TASK / "task.py").read_text()],
        }
        request = urllib.request.Request(server.url, data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=600) as response:
            print(json.load(response))


if __name__ == "__main__":
    main()
