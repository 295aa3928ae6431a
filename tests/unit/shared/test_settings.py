"""The settings cache: one ``Settings`` per process until it is cleared, and a ``Settings`` made
from the environment of before a clear is never kept past it."""

from __future__ import annotations

import threading

import pytest

from shared import settings as settings_module


class Made:
    """A stand-in for ``Settings`` that counts how it was made (the first one waits)."""

    count = 0
    release = threading.Event()
    entered = threading.Event()

    def __init__(self) -> None:
        Made.count += 1
        self.number = Made.count
        if self.number == 1:
            Made.entered.set()
            assert Made.release.wait(10)


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch) -> settings_module._SettingsCache:
    Made.count = 0
    Made.release.clear()
    Made.entered.clear()
    monkeypatch.setattr(settings_module, "Settings", Made)
    return settings_module._SettingsCache()


def test_one_settings_is_made_and_kept(cache: settings_module._SettingsCache) -> None:
    Made.release.set()
    first = cache()
    assert cache() is first
    cache.cache_clear()
    assert cache() is not first


def test_a_settings_made_across_a_clear_is_not_kept(
    cache: settings_module._SettingsCache,
) -> None:
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(cache()))
    reader.start()
    assert Made.entered.wait(10)  # a background thread is making settings from the old env
    cache.cache_clear()  # meanwhile the environment changes and the cache is cleared
    Made.release.set()
    reader.join(10)
    later = cache()
    assert got[0].number == 1  # type: ignore[attr-defined]
    assert later.number == 2  # made anew from the new environment, not the old one kept
    assert cache() is later
