"""bench_disk_path on a tiny geometry: every read covers the same bytes of the same folder."""

from __future__ import annotations

import argparse
import contextlib

import pytest

from radixlm.srt.bench.bench_disk_path import (
    fill_store,
    main,
    path_rate,
    pool_read_rate,
    raw_read_rate,
)

TINY = dict(num_pages=6, page_size=4, layers=2, heads=2, head_dim=8, read_chunk_kib=0)


@pytest.mark.parametrize("read_chunk_kib", [0, 1])  # a page is 2 KiB
def test_the_path_and_the_raw_read_cover_the_same_pages(tmp_path, read_chunk_kib):
    args = argparse.Namespace(**{**TINY, "read_chunk_kib": read_chunk_kib})
    store, pool, pages = fill_store(tmp_path, args)
    expected = [pool.page_bytes(i) for i in range(len(pages))]
    pool.data.zero_()
    for buffered in (False, True):  # straight into the pool's pages, and via read buffers
        pool.data.zero_()
        path_bytes, _ = path_rate(store, pool, pages, threads=2, buffered=buffered)
        assert path_bytes == len(pages) * pool.bytes_per_page
        assert [pool.page_bytes(i) for i in range(len(pages))] == expected  # every page
    pool.data.zero_()
    assert pool_read_rate(store, pool, pages, threads=2)[0] == path_bytes
    assert [pool.page_bytes(i) for i in range(len(pages))] == expected  # the bare copy too
    raw_bytes, _ = raw_read_rate(tmp_path, threads=2)
    assert raw_bytes == sum(p.stat().st_size for p in tmp_path.rglob("*.page")) > path_bytes
    assert raw_read_rate(tmp_path, threads=2, max_bytes=1)[0] == 0
    store.close()


@pytest.mark.parametrize("python_path", [False, True])
def test_main_prints_one_row_per_repeat(capsys, python_path):
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    args += ["--repeats", "2", "--threads", "2", "--busy-thread", "--phases"]
    main([*args, "--python-path"] if python_path else args)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 3  # the header line starts with the page count, then two runs
    phases = [line for line in out.splitlines() if "path phases" in line]
    assert len(phases) == 2
    if python_path:
        assert "Python path" in out and all("preadv" in line for line in phases)


@pytest.mark.parametrize("python_path", [False, True])
def test_phases_time_every_page_and_put_the_store_back(tmp_path, python_path):
    from radixlm.hicache import disk_store, native_page_io, page_file
    from radixlm.srt.bench.bench_disk_path import timed_phases

    if not python_path and native_page_io.get() is None:
        pytest.skip("the native page file helper cannot be built here")
    args = argparse.Namespace(**TINY)
    store, pool, pages = fill_store(tmp_path, args)
    expected = [pool.page_bytes(i) for i in range(len(pages))]
    real = (
        disk_store.DiskPageStore.get_into,
        page_file.preadv_into,
        page_file.xxhash,
        native_page_io.NativePageIO.read,
    )
    phases: dict = {}
    pool.data.zero_()
    paths = native_page_io.python_only() if python_path else contextlib.nullcontext()
    with paths, timed_phases(phases):
        path_rate(store, pool, pages, threads=2)
    assert [pool.page_bytes(i) for i in range(len(pages))] == expected  # still verified reads
    assert phases["pages"] == len(pages)
    if python_path:
        assert phases["read_wall_s"] >= phases["preadv_s"] > 0 and phases["hash_s"] > 0
        assert "native_s" not in phases
    else:
        assert phases["read_wall_s"] >= phases["native_s"] > 0
        assert "preadv_s" not in phases and "hash_s" not in phases
    assert (
        disk_store.DiskPageStore.get_into,
        page_file.preadv_into,
        page_file.xxhash,
        native_page_io.NativePageIO.read,
    ) == real
    store.close()
