"""A model call's retries: the first attempt runs outside tenacity, and a transient failure
is handed over to it, so the attempts, the failures recorded and the count in the error are
those of one retry loop."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.errors import ModelError, ModelPermanentError, ModelTransientError
from shared.ratelimit.in_process import LocalLimiter
from shared.settings import get_settings
from workers import model_calls
from workers.providers import ModelRequest, ModelResponse


class Flaky:
    """Fails transiently ``failures`` times, then answers (or fails for good, if told)."""

    def __init__(self, failures: int, *, then: ModelError | None = None) -> None:
        self.failures, self.then, self.calls = failures, then, 0

    def complete(self, request: ModelRequest) -> ModelResponse:
        self.calls += 1
        if self.calls <= self.failures:
            raise ModelTransientError(f"timeout {self.calls}")
        if self.then is not None:
            raise self.then
        return ModelResponse(content="done", tool_calls=[], input_tokens=3, output_tokens=1)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("RATCHET_MODEL_MAX_ATTEMPTS", "3")
    monkeypatch.setenv("RATCHET_MODEL_RETRY_BASE_SECONDS", "0")
    monkeypatch.setattr(model_calls, "get_limiter", LocalLimiter)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def request() -> ModelRequest:
    messages = [{"role": "user", "content": "hi"}]
    return ModelRequest(task_id="t", step=1, model="m", messages=messages, tools=[], options={})


def complete(provider: Flaky, *, prior: int = 0, failed: list[dict[str, object]]) -> ModelResponse:
    return model_calls.complete(
        provider,  # type: ignore[arg-type]
        request(),
        model="test:m",
        tenant="t",
        prior_failures=prior,
        failed=failed,
    )


@pytest.mark.parametrize("failures", [0, 1, 2])
def test_transient_failures_are_retried_up_to_the_attempts(failures: int) -> None:
    provider, failed = Flaky(failures), []
    assert complete(provider, failed=failed).content == "done"
    assert provider.calls == failures + 1
    assert [f["error"]["message"] for f in failed] == [  # type: ignore[index]
        f"timeout {n}" for n in range(1, failures + 1)
    ]


@pytest.mark.parametrize(("prior", "calls"), [(0, 3), (1, 2), (2, 1)])
def test_the_attempts_run_out_counting_the_steps_earlier_failures(prior: int, calls: int) -> None:
    provider, failed = Flaky(10), []
    with pytest.raises(ModelTransientError, match=r"\(after 3 attempts\)"):
        complete(provider, prior=prior, failed=failed)
    assert provider.calls == calls
    assert len(failed) == calls


@pytest.mark.parametrize("failures", [0, 1])
def test_a_permanent_error_is_not_retried(failures: int) -> None:
    provider, failed = Flaky(failures, then=ModelPermanentError("bad request")), []
    with pytest.raises(ModelPermanentError, match=rf"bad request \(after {failures + 1} attempts"):
        complete(provider, failed=failed)
    assert provider.calls == failures + 1
