"""Media fetching safety (`inputs/fetch.py`) against a real loopback HTTP server, and video decoding
(`inputs/video.py`) of real encoded files. Only loopback addresses are ever contacted."""

from __future__ import annotations

import socket

import pytest

from mmserve.errors import InvalidInputError
from mmserve.inputs.fetch import FetchPolicy, _is_public, fetch_url
from mmserve.inputs.video import decode_video
from tests.e2e.conftest import file_server
from tests.e2e.test_server import mp4_bytes, png_bytes


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    (root / "red.png").write_bytes(png_bytes((220, 20, 20)))
    with file_server(root) as base:
        yield base, (root / "red.png").read_bytes()


def test_loopback_refused_by_default(files):
    base, _ = files
    for url in (f"{base}/red.png", base.replace("127.0.0.1", "localhost") + "/red.png"):
        with pytest.raises(InvalidInputError, match="private, loopback or link-local"):
            fetch_url(url, 10**6, FetchPolicy())


def test_allow_private_fetches_and_follows_redirects(files):
    base, data = files
    policy = FetchPolicy(allow_private=True)
    assert fetch_url(f"{base}/red.png", 10**6, policy) == data
    assert fetch_url(f"{base}/redirect?to=/red.png", 10**6, policy) == data


def test_every_redirect_hop_is_checked(files):
    base, data = files
    trusted = base.replace("127.0.0.1", "localhost")
    policy = FetchPolicy(allowed_domains=("localhost",))
    assert fetch_url(f"{trusted}/red.png", 10**6, policy) == data
    with pytest.raises(InvalidInputError, match="not in the allowed media domains"):
        fetch_url(f"{trusted}/redirect?to={base}/red.png", 10**6, policy)
    with pytest.raises(InvalidInputError, match="not in the allowed media domains"):
        fetch_url(f"{base}/red.png", 10**6, policy)


def test_byte_cap_status_scheme_and_timeout(files):
    base, data = files
    policy = FetchPolicy(allow_private=True, timeout_s=0.5)
    with pytest.raises(InvalidInputError, match="over the limit"):
        fetch_url(f"{base}/red.png", len(data) - 1, policy)
    with pytest.raises(InvalidInputError, match="HTTP 404"):
        fetch_url(f"{base}/missing.png", 10**6, policy)
    with pytest.raises(InvalidInputError, match="scheme"):
        fetch_url("ftp://127.0.0.1/x.png", 10**6, policy)
    with socket.socket() as silent:  # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        with pytest.raises(InvalidInputError, match="timed out"):
            fetch_url(f"http://127.0.0.1:{silent.getsockname()[1]}/x", 10**6, policy)


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
                                     "100.64.0.1", "0.0.0.0", "224.0.0.1", "::1", "fe80::1", "fc00::1",
                                     "::ffff:127.0.0.1"])
def test_non_public_addresses(address):
    assert not _is_public(address)


def test_public_address():
    assert _is_public("8.8.8.8") and _is_public("2606:4700:4700::1111")


def test_video_sampling_by_fps_and_max_frames():
    data = mp4_bytes(num_frames=12, fps=6)  # two seconds
    assert len(decode_video(data, fps=2.0, max_frames=32, max_pixels=10**6)) == 4
    frames = decode_video(data, fps=6.0, max_frames=3, max_pixels=10**6)  # spread over the whole video
    assert len(frames) == 3 and frames[0].shape == (48, 64, 3)
    assert frames[0].mean() < frames[1].mean() < frames[2].mean()
    with pytest.raises(InvalidInputError, match="pixels per frame"):
        decode_video(data, fps=2.0, max_frames=4, max_pixels=1000)
    with pytest.raises(InvalidInputError, match="could not be decoded"):
        decode_video(data[: len(data) // 3] + b"\0" * 100, fps=2.0, max_frames=4, max_pixels=10**6)
