"""OpenRLHF: the remote reward server, the `reward_func` file, and a multi-turn `AgentExecutor`.

Written against OpenRLHF 0.11.0 (`OpenRLHF/OpenRLHF`, August 2026; PyPI 0.11.2), whose flags are namespaced since
0.10.2 (`--reward.remote_url`, `--train.agent_func_path`, `--data.label_key`):

- `--reward.remote_url http://host:port/get_reward`: OpenRLHF POSTs `{"query": [...], "prompts": [...], "labels":
  [...]}` (each a list, one item per sample; `query` is prompt and response as one text) and reads `{"rewards",
  "scores", "extra_logs"}`. `RewardServer` serves that with the standard library (`python -m
  kforge.adapters.openrlhf --port 5000`).
- `--reward.remote_url /path/reward.py`: the file's `reward_func(queries, prompts, labels)` is called in a thread
  and returns tensors; `reward_func` here is that function.
- `--train.agent_func_path /path/agent.py`: the file's `AgentExecutor`, a subclass of OpenRLHF's
  `AgentExecutorBase` made with no arguments, runs one `AgentInstanceBase` per sample: `async reset(states)` and
  `async step(states)` returning `rewards` (a tensor), `scores`, `environment_feedback`, `done`. `KforgeAgent` is
  that behaviour; `agent_executor_class()` builds the two classes on OpenRLHF's bases (imported only then).

The label (`--data.label_key`) names the task: its reference source, or a task id of `KFORGE_TASKS`. `scores`
(OpenRLHF's dynamic-filtering signal, in [0, 1]) is whether the kernel was correct.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Final, Self

from kforge.adapters._common import (
    AdapterConfig,
    ClientPool,
    KernelOutcome,
    Scorer,
    TaskLike,
    feedback_text,
    start_kwargs,
    task_from_fields,
)
from kforge.episodes import AsyncEpisode
from kforge.v1 import orchestrator_pb2

__all__ = [
    "CHATML_FEEDBACK",
    "KforgeAgent",
    "RewardServer",
    "agent_executor_class",
    "main",
    "reward_func",
    "reward_payload",
    "score_request",
]

log = logging.getLogger("kforge.adapters.openrlhf")


def _response(query: str, prompt: str) -> str:
    """The response part of OpenRLHF's `query` (prompt and response as one text)."""
    return query[len(prompt) :] if prompt and query.startswith(prompt) else query


def _items(queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any], tasks: str | None) -> list[Any]:
    if not len(queries) == len(prompts) == len(labels):
        raise ValueError(f"query, prompts and labels differ in length: {len(queries)}, {len(prompts)}, {len(labels)}")
    items: list[tuple[TaskLike | Exception, str]] = []
    for query, prompt, label in zip(queries, prompts, labels, strict=True):
        try:
            task: TaskLike | Exception = task_from_fields(label, tasks=tasks)
        except Exception as error:  # recorded as the sample's outcome
            task = error
        items.append((task, _response(str(query), str(prompt))))
    return items


def reward_payload(outcomes: Sequence[KernelOutcome]) -> dict[str, Any]:
    """OpenRLHF's reward answer as lists: `rewards`, `scores` (correct: 0/1) and `extra_logs` per sample."""
    return {
        "rewards": [outcome.reward for outcome in outcomes],
        "scores": [float(outcome.correct) for outcome in outcomes],
        "extra_logs": {
            "kforge_correct": [float(outcome.correct) for outcome in outcomes],
            "kforge_speedup": [outcome.speedup for outcome in outcomes],
            "kforge_format_error": [float(bool(outcome.format_error)) for outcome in outcomes],
            "kforge_error": [float(bool(outcome.error)) for outcome in outcomes],
        },
    }


def score_request(scorer: Scorer, payload: Mapping[str, Any]) -> dict[str, Any]:
    """Scores a `/get_reward` request body; ValueError naming what is malformed."""
    lists: dict[str, list[Any]] = {}
    for key in ("query", "prompts", "labels"):
        value = payload.get(key)
        if not isinstance(value, list):
            raise ValueError(f"{key}: expected a list, got {type(value).__name__}")
        lists[key] = value
    outcomes = scorer.score_batch(_items(lists["query"], lists["prompts"], lists["labels"], scorer.config.tasks))
    return reward_payload(outcomes)


def _torch() -> Any | None:
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


_DEFAULT_SCORER: list[Scorer] = []


def reward_func(queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any], **kwargs: Any) -> dict[str, Any]:
    """The reward-function file's entry point: each sample's kforge reward, configured by `KFORGE_*`.

    Returns `rewards`, `scores` and `extra_logs` values as float tensors (lists where torch is absent). A sample
    whose label names no task, or whose call failed, gets the `error_reward` and `kforge_error` 1.
    """
    if not _DEFAULT_SCORER:
        _DEFAULT_SCORER.append(Scorer(AdapterConfig.from_env()))
    scorer = _DEFAULT_SCORER[0]
    payload = reward_payload(scorer.score_batch(_items(queries, prompts, labels, scorer.config.tasks)))
    torch = _torch()
    if torch is None:
        return payload
    tensor = torch.tensor
    return {
        "rewards": tensor(payload["rewards"], dtype=torch.float32),
        "scores": tensor(payload["scores"], dtype=torch.float32),
        "extra_logs": {key: tensor(value, dtype=torch.float32) for key, value in payload["extra_logs"].items()},
    }


# ---------------------------------------------------------------------------------------------------------------------
# The HTTP server


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/get_reward":
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}: POST /get_reward"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            payload = json.loads(self.rfile.read(length) or b"null")
            if not isinstance(payload, dict):
                raise ValueError("the body must be a JSON object")
            answer = score_request(self.server.scorer, payload)
        except ValueError as error:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(error)})
            return
        self._send(HTTPStatus.OK, answer)

    def do_GET(self) -> None:
        if self.path.rstrip("/") in ("/health", ""):
            self._send(HTTPStatus.OK, {"status": "ok"})
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}: POST /get_reward"})

    def _send(self, status: HTTPStatus, body: Mapping[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], scorer: Scorer) -> None:
        super().__init__(address, _Handler)
        self.scorer = scorer


class RewardServer:
    """OpenRLHF's remote reward model, served by kforge: `POST /get_reward` (and `GET /health`).

    `RewardServer(config, port=5000).start()` serves on a thread (`url` is the address to pass as
    `--reward.remote_url`); `serve_forever()` serves on the calling thread. Requests are served concurrently, and
    the samples of one request `concurrency` at a time.
    """

    def __init__(self, config: AdapterConfig | None = None, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.scorer = Scorer(config or AdapterConfig.from_env())
        self._server = _Server((host, port), self.scorer)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The endpoint: `http://host:port/get_reward`."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/get_reward"

    def start(self) -> Self:
        """Serves on a daemon thread."""
        self._thread = threading.Thread(target=self._server.serve_forever, name="kforge-openrlhf", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serves on the calling thread until `stop` (or KeyboardInterrupt)."""
        self._server.serve_forever()

    def stop(self) -> None:
        """Stops serving and closes the socket and the kforge client."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()
        self.scorer.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m kforge.adapters.openrlhf [--host H] [--port P]`: serves `/get_reward` until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m kforge.adapters.openrlhf", description=main.__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    arguments = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    server = RewardServer(AdapterConfig.from_env(), host=arguments.host, port=arguments.port)
    log.info("serving %s (kforge orchestrator %s)", server.url, server.scorer.config.orchestrator)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------------------------------
# The agent

CHATML_FEEDBACK: Final = "<|im_end|>\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n"
"""The feedback between two turns in ChatML (Qwen's template): OpenRLHF appends it to the tokens as it is."""

_POOLS: dict[AdapterConfig, ClientPool] = {}


class KforgeAgent:
    """One OpenRLHF sample as a kforge episode: what `AgentInstanceBase.reset` and `step` do.

    `reset` starts the episode on the label's task and leaves the prompt as the dataset made it; each `step`
    sends the action text as the turn's response and returns the turn's reward (OpenRLHF sums them), `scores` (1
    once a kernel was correct), the feedback in `feedback_template` (the model's chat format), and `done`. A task
    the label does not name, or a failed call, ends the sample with the `error_reward` and `kforge_error` 1.
    """

    def __init__(self, config: AdapterConfig | None = None, *, feedback_template: str = CHATML_FEEDBACK) -> None:
        self.config = config or AdapterConfig.from_env()
        self.feedback_template = feedback_template
        self._pool = _POOLS.setdefault(self.config, ClientPool(self.config))
        self._observation: orchestrator_pb2.Observation | None = None
        self._error = ""
        self._correct = False

    async def reset(self, states: Mapping[str, Any], **kwargs: Any) -> dict[str, Any]:
        """Starts the episode; returns `{"observation": states["observation"]}` (the prompt unchanged)."""
        self._observation, self._error, self._correct = None, "", False
        try:
            task = task_from_fields(states.get("label"), tasks=self.config.tasks)
            episode = await AsyncEpisode.start(
                self._pool.for_loop().orchestrator, task=task, **start_kwargs(self.config)
            )
            self._observation = episode.observation
        except Exception as error:  # the first step ends the sample with the error recorded
            self._error = KernelOutcome.from_error(error).error
            log.warning("kforge: no episode for a sample: %s", self._error)
        return {"observation": states.get("observation", "")}

    async def step(self, states: Mapping[str, Any], **kwargs: Any) -> dict[str, Any]:
        """Steps the episode with `states["action_text"]`; OpenRLHF's step result."""
        outcome: KernelOutcome
        observation = self._observation
        if observation is None or self._error:
            outcome = KernelOutcome(
                reward=self.config.error_reward, error=self._error or "no episode", error_code="TASK"
            )
        else:
            episode = AsyncEpisode(self._pool.for_loop().orchestrator, observation)
            try:
                observation = await episode.step(str(states.get("action_text", "")), timeout=self.config.timeout)
                outcome = KernelOutcome.from_observation(observation, error_reward=self.config.error_reward)
                self._observation = observation
            except Exception as error:  # the sample ends with the error recorded
                outcome = KernelOutcome.from_error(error, error_reward=self.config.error_reward, episode_id=episode.id)
        self._correct = self._correct or outcome.correct
        done = bool(outcome.error) or observation is None or observation.done
        feedback = ""
        if not done and observation is not None:
            text = feedback_text(observation, turns_left=self.config.turns - observation.turn)
            feedback = self.feedback_template.format(feedback=text)
        return {
            "rewards": _scalar(outcome.reward),
            "scores": _scalar(float(self._correct)),
            "environment_feedback": feedback,
            "done": done,
            "sampling_params": states.get("sampling_params"),
            "extra_logs": {
                "kforge_correct": _scalar(float(outcome.correct)),
                "kforge_speedup": _scalar(outcome.speedup),
                "kforge_error": _scalar(float(bool(outcome.error))),
            },
        }


def _scalar(value: float) -> Any:
    """A 0-d float tensor where torch is installed (OpenRLHF calls `.item()`), else the float."""
    torch = _torch()
    return value if torch is None else torch.tensor(value, dtype=torch.float32)


_AGENT_CLASSES: dict[AdapterConfig | None, tuple[type[Any], type[Any]]] = {}


def agent_executor_class(config: AdapterConfig | None = None, *, feedback_template: str = CHATML_FEEDBACK) -> type[Any]:
    """The `AgentExecutor` class for an agent file: OpenRLHF's `MultiTurnAgentExecutor` over `KforgeAgent`.

    Its `AgentInstance` subclasses OpenRLHF's `AgentInstanceBase`. Raises ImportError where OpenRLHF is not
    installed. An agent file holds: `AgentExecutor = agent_executor_class()`.
    """
    if config not in _AGENT_CLASSES:
        agent = importlib.import_module("openrlhf.utils.agent")

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            KforgeAgent.__init__(self, config, feedback_template=feedback_template)

        instance = type(
            "AgentInstance",
            (KforgeAgent, agent.AgentInstanceBase),
            {"__init__": __init__, "__module__": __name__, "__doc__": KforgeAgent.__doc__},
        )

        def executor_init(self: Any) -> None:
            agent.MultiTurnAgentExecutor.__init__(self, instance)

        executor = type(
            "AgentExecutor",
            (agent.MultiTurnAgentExecutor,),
            {"__init__": executor_init, "__module__": __name__, "__doc__": "kforge episodes as OpenRLHF agents."},
        )
        _AGENT_CLASSES[config] = (instance, executor)
    return _AGENT_CLASSES[config][1]


if __name__ == "__main__":
    main()
