"""slime: reward functions for `--custom-rm-path`, a reward post-process, and a `generate` running whole episodes.

Written against slime 0.3.1 (`THUDM/slime`, August 2026; not on PyPI), whose hooks are dotted paths loaded with
`importlib`, so `kforge.adapters.slime` must import on the rollout workers; slime itself is never imported here
(its `Sample` is used by its attributes only):

- `--custom-rm-path kforge.adapters.slime.reward`: `async reward(args, sample) -> float`, awaited per sample.
- `--group-rm --custom-rm-path kforge.adapters.slime.group_reward`: `async group_reward(args, samples)`, one call
  per prompt group.
- `--custom-reward-post-process-path kforge.adapters.slime.post_process_rewards`: `(raw, used for training)`:
  rewards normalised within each group of `--n-samples-per-prompt` over the samples kforge scored; a sample whose
  kforge call failed trains on 0 (no advantage) instead of skewing its group.
- `--custom-generate-function-path kforge.adapters.slime.generate`: `async generate(args, sample,
  sampling_params)` runs one kforge episode with slime's SGLang router, sets the sample's tokens, loss mask,
  log-probabilities, status and `reward` (so slime's reward model is skipped for it).

The sample's task: `sample.metadata["task_source"]`, `sample.metadata["task_id"]`, else `sample.label` (a
reference source or a task id of `KFORGE_TASKS`). Each sample's outcome is kept in `sample.metadata["kforge"]`.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import statistics
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kforge.adapters._common import (
    AdapterConfig,
    ClientPool,
    Generate,
    Generation,
    KernelOutcome,
    Scorer,
    Tokenizer,
    TokenTrajectory,
    run_token_episode,
    start_kwargs,
    task_from_fields,
)
from kforge.episodes import AsyncEpisode

__all__ = [
    "generate",
    "group_reward",
    "make_generate",
    "post_process_rewards",
    "reward",
    "sample_task",
    "sglang_engine",
]

_SCORERS: dict[AdapterConfig, Scorer] = {}


def _scorer() -> Scorer:
    config = AdapterConfig.from_env()
    return _SCORERS.setdefault(config, Scorer(config))


def _metadata(sample: Any) -> dict[str, Any]:
    metadata = getattr(sample, "metadata", None)
    if not isinstance(metadata, dict):
        metadata = {}
        sample.metadata = metadata
    return metadata


def sample_task(sample: Any, tasks: str | None) -> Any:
    """The kforge task of a slime `Sample`: `metadata["task_source"]`, `metadata["task_id"]`, then `label`."""
    metadata = _metadata(sample)
    return task_from_fields(metadata.get("task_source"), metadata.get("task_id"), sample.label, tasks=tasks)


async def _score(scorer: Scorer, sample: Any) -> KernelOutcome:
    try:
        outcome = await scorer.ascore(sample_task(sample, scorer.config.tasks), str(sample.response))
    except Exception as error:  # recorded in the sample; the rollout goes on
        outcome = KernelOutcome.from_error(error, error_reward=scorer.config.error_reward)
    _metadata(sample)["kforge"] = outcome.as_dict()
    return outcome


async def reward(args: Any, sample: Any, **kwargs: Any) -> float:
    """The sample's kforge reward: its response scored as a one-turn episode (`--custom-rm-path`)."""
    return (await _score(_scorer(), sample)).reward


async def group_reward(args: Any, samples: Sequence[Any], **kwargs: Any) -> list[float]:
    """The rewards of one prompt's samples, scored concurrently (`--group-rm --custom-rm-path`)."""
    scorer = _scorer()
    semaphore = asyncio.Semaphore(scorer.config.concurrency)

    async def one(sample: Any) -> float:
        async with semaphore:
            return (await _score(scorer, sample)).reward

    return list(await asyncio.gather(*(one(sample) for sample in samples)))


def _reward_value(args: Any, sample: Any) -> float:
    value = sample.reward
    if isinstance(value, Mapping):
        value = value[getattr(args, "reward_key", None) or "score"]
    return float(value or 0.0)


def _failed(sample: Any) -> bool:
    outcome = _metadata(sample).get("kforge")
    return isinstance(outcome, Mapping) and bool(outcome.get("error"))


def post_process_rewards(args: Any, samples: Sequence[Any]) -> tuple[list[float], list[float]]:
    """(raw rewards, rewards to train on) for `--custom-reward-post-process-path`.

    Within each group of `args.n_samples_per_prompt` consecutive samples, the rewards of the samples kforge scored
    are centred on their mean (and divided by their standard deviation when `args.rewards_normalization` is on);
    a sample whose kforge call failed trains on 0, as do the samples of a group with fewer than two scored.
    """
    raw = [_reward_value(args, sample) for sample in samples]
    size = int(getattr(args, "n_samples_per_prompt", 1) or 1)
    scale = bool(getattr(args, "rewards_normalization", True))
    used = [0.0] * len(raw)
    for start in range(0, len(raw), size):
        indices = [i for i in range(start, min(start + size, len(raw))) if not _failed(samples[i])]
        if len(indices) < 2:
            continue
        values = [raw[i] for i in indices]
        mean = statistics.fmean(values)
        spread = statistics.pstdev(values) if scale else 1.0
        for i in indices:
            used[i] = (raw[i] - mean) / (spread + 1e-6) if scale else raw[i] - mean
    return raw, used


# ---------------------------------------------------------------------------------------------------------------------
# Generation: a whole episode


def sglang_engine(args: Any, sampling_params: Mapping[str, Any]) -> Generate:
    """Slime's SGLang router (`args.sglang_router_ip`, `args.sglang_router_port`) as a `Generate`.

    It POSTs `/generate` with `input_ids`, the sampling parameters (`max_new_tokens` the budget) and
    `return_logprob`, and reads `meta_info.output_token_logprobs` and `meta_info.finish_reason`.
    """
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"

    def post(body: bytes) -> Any:
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as response:
            return json.load(response)

    async def engine(prompt_ids: list[int], budget: int) -> Generation:
        params = {**sampling_params, "max_new_tokens": min(budget, int(sampling_params.get("max_new_tokens", budget)))}
        body = json.dumps({"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True}).encode()
        output = await asyncio.to_thread(post, body)
        meta = output.get("meta_info", {})
        pairs = meta.get("output_token_logprobs") or []
        finish = meta.get("finish_reason")
        finish_type = finish.get("type") if isinstance(finish, Mapping) else finish
        return Generation(
            token_ids=[int(pair[1]) for pair in pairs],
            log_probs=[float(pair[0]) for pair in pairs],
            finish_reason="length" if finish_type == "length" else "stop",
        )

    return engine


@functools.cache
def _hf_tokenizer(path: str) -> Tokenizer:
    transformers = importlib.import_module("transformers")
    tokenizer: Tokenizer = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    return tokenizer


_POOLS: dict[AdapterConfig, ClientPool] = {}


def _status(sample: Any, name: str) -> Any:
    status = getattr(type(sample), "Status", None)
    return getattr(status, name) if status is not None else name.lower()


def _apply(sample: Any, trajectory: TokenTrajectory, tokenizer: Tokenizer) -> None:
    sample.tokens = trajectory.prompt_ids + trajectory.response_ids
    sample.response_length = len(trajectory.response_ids)
    sample.loss_mask = trajectory.response_mask
    sample.rollout_log_probs = trajectory.response_logprobs
    sample.response = tokenizer.decode(trajectory.response_ids, skip_special_tokens=False)
    sample.reward = trajectory.reward
    name = "ABORTED" if trajectory.error else "TRUNCATED" if trajectory.truncated else "COMPLETED"
    sample.status = _status(sample, name)
    _metadata(sample)["kforge"] = trajectory.metrics()


def make_generate(
    config: AdapterConfig | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    engine: Callable[[Any, Mapping[str, Any]], Generate] = sglang_engine,
) -> Callable[..., Any]:
    """A slime `generate(args, sample, sampling_params)` running one kforge episode per sample.

    `tokenizer`: default `transformers.AutoTokenizer` of `args.hf_checkpoint`; `engine(args, sampling_params)`:
    default slime's SGLang router. The response budget is `args.rollout_max_response_len`.
    """
    resolved = config or AdapterConfig.from_env()
    pool = _POOLS.setdefault(resolved, ClientPool(resolved))

    async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> Any:
        """Runs one kforge episode for `sample` and sets its tokens, mask, log-probabilities, status and reward."""
        chosen = tokenizer or _hf_tokenizer(str(args.hf_checkpoint))
        budget = int(getattr(args, "rollout_max_response_len", 0) or sampling_params.get("max_new_tokens", 4096))
        try:
            task = sample_task(sample, resolved.tasks)
            episode = await AsyncEpisode.start(pool.for_loop().orchestrator, task=task, **start_kwargs(resolved))
        except Exception as error:  # the sample is aborted with its error recorded
            outcome = KernelOutcome.from_error(error, error_reward=resolved.error_reward)
            trajectory = TokenTrajectory(
                prompt_ids=list(sample.tokens or []), outcomes=[outcome], reward=outcome.reward
            )
        else:
            prompt = sample.prompt
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            trajectory = await run_token_episode(
                episode,
                tokenizer=chosen,
                generate=engine(args, sampling_params),
                max_response_tokens=budget,
                config=resolved,
                prompt_messages=messages if resolved.prompt == "dataset" else None,
            )
        _apply(sample, trajectory, chosen)
        return sample

    return generate


_DEFAULT_GENERATE: list[Callable[..., Any]] = []


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> Any:
    """`--custom-generate-function-path kforge.adapters.slime.generate`: `make_generate()` with `KFORGE_*`."""
    if not _DEFAULT_GENERATE:
        _DEFAULT_GENERATE.append(make_generate())
    return await _DEFAULT_GENERATE[0](args, sample, sampling_params, evaluation)
