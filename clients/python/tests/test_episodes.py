"""The Step API helper against the real orchestrator, evaluator and reward services, on a CPU task."""

from __future__ import annotations

import pytest
from example_tasks import example_candidate, example_task
from kforge_mesh import KforgeMesh

import kforge
from kforge.v1 import common_pb2, gateway_pb2, orchestrator_pb2

SUMMARY = "I folded the scale into one torch.add call, so the sum is a single pass over the inputs."


def answer(kernel: str, summary: str = SUMMARY) -> str:
    """A response in the kevin recipe's strict format: closed reasoning, a summary, one fenced ModelNew block."""
    return f"<think>Okay, alpha * a + b is one add with alpha.</think>{summary}\n\n```python\n{kernel}\n```\n"


def test_a_kevin_episode_steps_turn_by_turn_and_is_credited_at_its_end(client: kforge.Client) -> None:
    kernel = example_candidate("scaled_add")
    episode = kforge.Episode.start(
        client.orchestrator, recipe="kevin", task=example_task("scaled_add"), turns=2, backend="cpu"
    )
    assert (episode.turn, episode.done, episode.reward, episode.record) == (0, False, 0.0, None)
    assert [m["role"] for m in episode.messages] == [m.role for m in episode.prompt]
    assert any("alpha" in m.content for m in episode.prompt), "the task's source is in the prompt"
    start = episode.observation

    first = episode.step(answer(kernel), prompt_token_ids=[1, 2, 3])
    assert first.record.verdict == common_pb2.VERDICT_CORRECT, first.record
    assert list(first.record.prompt_token_ids) == [1, 2, 3], "the trainer's prompt tokens are stored with the turn"
    resumed = kforge.Episode.resume(client.orchestrator, episode.id)
    assert (resumed.turn, resumed.prompt, resumed.reward) == (1, episode.prompt, episode.reward), "where it stands"
    assert episode.evaluation is not None
    assert episode.evaluation.device == "cpu"
    assert episode.reward >= 0.3, "the Kevin score of a correct kernel: 0.3 plus its speedup"
    assert (episode.turn, episode.done) == (1, False)
    assert SUMMARY in "".join(m["content"] for m in episode.messages), "the refine prompt shows the attempt"

    # Turn 0 stepped again by a helper taking the episode up at its start (a trainer's retry after a lost answer):
    # the same key, so the orchestrator replays the stored step instead of evaluating again.
    retried = kforge.Episode(client.orchestrator, start)
    assert retried.idempotency_key() == episode.idempotency_key(0)
    replayed = retried.step(answer(kernel))
    assert replayed.evaluation == first.evaluation, "one evaluation, stored and replayed"
    assert (replayed.turn, replayed.reward, replayed.prompt) == (first.turn, first.reward, first.prompt)

    last = episode.step(answer(kernel, summary=""))  # no summary: out of the strict format, not evaluated, scored 0
    assert last.record.format_error
    assert not last.HasField("evaluation")
    assert (episode.reward, episode.done, episode.prompt) == (0.0, True, [])
    assert [turn.turn for turn in episode.turns] == [0, 1]
    assert all(turn.HasField("return_value") and turn.HasField("advantage") for turn in episode.turns)
    assert episode.turns[0].return_value == pytest.approx(episode.turns[0].score)


def test_an_unknown_backend_name_is_refused_before_any_call(client: kforge.Client) -> None:
    with pytest.raises(ValueError, match="BACKEND_TPU"):
        kforge.Episode.start(client.orchestrator, recipe="kevin", task=example_task("relu"), backend="tpu")


def test_reasoning_goes_with_a_text_not_a_completion(client: kforge.Client) -> None:
    episode = kforge.Episode(client.orchestrator, orchestrator_pb2.Observation(episode_id="e", turn=0))
    with pytest.raises(ValueError, match="reasoning"):
        episode.step(gateway_pb2.Completion(text="x"), reasoning="why")


async def test_an_async_single_turn_episode(mesh: KforgeMesh) -> None:
    async with kforge.AsyncClient(mesh.addresses) as client:
        episode = await kforge.AsyncEpisode.start(
            client.orchestrator, recipe="single-turn", task=example_task("scaled_add"), backend="cpu"
        )
        assert episode.prompt
        observation = await episode.step(answer(example_candidate("scaled_add")))
    assert observation.done
    assert episode.record is not None
    assert episode.record.verdict == common_pb2.VERDICT_CORRECT
    assert len(episode.turns) == 1
