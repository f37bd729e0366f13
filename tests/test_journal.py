"""The journal: leveldb's log framing, a writer that reserves then writes, a reader that tails it.

What a reader returns is checked against what was written, for every way the file can be found:
whole, cut at any byte, corrupted, with a reserved range not yet written, written by 8 threads at
once, left by a process killed in the middle of its loop.
"""

import json
import os
import random
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_forge.journal import JournalReader, JournalWriter
from otel_forge.journal.framing import BLOCK_SIZE, HEADER_SIZE, RecordType, frame


def _write(path: Path, payloads: list[bytes]) -> list[int]:
    """Append ``payloads``; the writer's end after each (the cursor the reader should hand out)."""
    ends = []
    with JournalWriter(path) as writer:
        for payload in payloads:
            writer.append(payload)
            ends.append(writer.end)
    return ends


def _read_all(path: Path, offset: int = 0, final: bool = False) -> tuple[list[tuple[bytes, int]], JournalReader]:
    reader = JournalReader(path, offset)
    records = reader.read(final=final)
    reader.close()
    return records, reader


def _payload(number: int, size: int) -> bytes:
    """A payload that says which it is and whose every byte can be checked."""
    head = b"%d:" % number
    return head + bytes((number + i) % 251 for i in range(max(0, size - len(head))))


def _intact(payload: bytes) -> int:
    """The number of a ``_payload``, after checking every byte of it."""
    number = int(payload.split(b":", 1)[0])
    assert payload == _payload(number, len(payload)), f"record {number} is not what was written"
    return number


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    return tmp_path / "journal.log"


# --- the framing ---------------------------------------------------------------------------------


def test_a_record_is_leveldbs_header_then_the_data():
    # checksum: zlib.crc32 over the type byte then the data, little-endian; length LE; type.
    expected = struct.pack("<IHB", zlib.crc32(b"\x01abc"), 3, 1) + b"abc"
    assert frame(0, b"abc") == expected
    assert frame(BLOCK_SIZE + 100, b"abc") == expected


def test_fewer_than_a_header_left_in_a_block_is_a_trailer_of_zeros():
    data = frame(BLOCK_SIZE - 6, b"abc")
    assert data[:6] == bytes(6)
    assert data[6:] == frame(0, b"abc")


def test_exactly_a_header_left_in_a_block_holds_an_empty_first_fragment():
    data = frame(BLOCK_SIZE - HEADER_SIZE, b"abc")
    assert data[:HEADER_SIZE] == struct.pack("<IHB", zlib.crc32(b"\x02"), 0, RecordType.FIRST)
    assert data[HEADER_SIZE + 4 : HEADER_SIZE + 7] == b"\x03\x00\x04"  # then LAST, length 3
    assert data[-3:] == b"abc"


def test_a_record_longer_than_a_block_is_first_middle_last():
    data = frame(0, bytes(2 * BLOCK_SIZE))
    kinds = [data[offset + 6] for offset in (0, BLOCK_SIZE, 2 * BLOCK_SIZE)]
    assert kinds == [RecordType.FIRST, RecordType.MIDDLE, RecordType.LAST]
    assert len(data) == 2 * BLOCK_SIZE + 3 * HEADER_SIZE


# --- round trips ---------------------------------------------------------------------------------


def _leaving(end: int, left: int) -> int:
    """The size of a payload that, written at ``end``, leaves ``left`` bytes in its block."""
    return BLOCK_SIZE - end % BLOCK_SIZE - HEADER_SIZE - left


def test_payloads_of_every_awkward_size_come_back_whole_and_in_order(journal):
    payloads: list[bytes] = []
    with JournalWriter(journal) as writer:

        def append(payload: bytes) -> int:
            payloads.append(payload)
            writer.append(payload)
            return writer.end

        append(b"")
        append(b"x")
        assert append(_payload(1, _leaving(writer.end, 0))) == BLOCK_SIZE  # fills block 0 exactly
        assert append(_payload(2, BLOCK_SIZE - HEADER_SIZE)) == 2 * BLOCK_SIZE  # fills block 1
        append(b"")
        assert append(_payload(3, 100_000)) > 5 * BLOCK_SIZE  # FIRST, MIDDLE, MIDDLE, LAST
        assert BLOCK_SIZE - append(_payload(4, _leaving(writer.end, 6))) % BLOCK_SIZE == 6
        assert append(b"after a trailer") % BLOCK_SIZE == HEADER_SIZE + 15
        append(_payload(5, _leaving(writer.end, HEADER_SIZE)))
        append(b"after an empty first fragment")
        for number in range(6, 500):  # small ones across block boundaries
            append(_payload(number, 200))
        end = writer.end

    records, reader = _read_all(journal)

    assert [payload for payload, _ in records] == payloads
    assert records[-1][1] == reader.offset == end == journal.stat().st_size
    assert reader.skipped == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    payloads=st.lists(
        st.one_of(
            st.binary(max_size=300),
            st.builds(lambda size, byte: bytes([byte]) * size, st.integers(0, 70_000), st.integers(0, 255)),
        ),
        max_size=30,
    ),
    split=st.integers(0, 30),
    limit=st.integers(1, 7),
)
def test_any_payloads_read_back_exactly_with_increasing_offsets_ending_at_the_file_size(payloads, split, limit):
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "journal.log"
        ends = _write(path, payloads[:split])
        ends += _write(path, payloads[split:])  # a second writer goes on from the file's size
        reader = JournalReader(path)
        records: list[tuple[bytes, int]] = []
        while batch := reader.read(limit=limit):
            assert len(batch) <= limit
            records += batch
        reader.close()

        assert [payload for payload, _ in records] == payloads
        offsets = [end for _, end in records]
        assert offsets == ends
        assert all(a < b for a, b in zip(offsets, offsets[1:], strict=False))
        assert reader.offset == path.stat().st_size == (ends[-1] if ends else 0)


# --- torn and damaged ----------------------------------------------------------------------------

# Two layouts of five records across two blocks: one record split across the boundary (its first
# fragment empty, as when exactly a header's room is left), and a trailer before the boundary.
_LAYOUTS = {
    "fragment across blocks": [10, 20_000, BLOCK_SIZE - 17 - 20_007 - 2 * HEADER_SIZE, 50, 0],
    "trailer before a block": [10, 20_000, BLOCK_SIZE - 17 - 20_007 - HEADER_SIZE - 3, 50, 0],
}


def _cuts(ends: list[int]) -> list[int]:
    """Every size within two headers of a record's start or end or of the block boundary, where a cut
    meets a header, a fragment or the trailer; every 61st byte elsewhere (inside a payload every cut
    reads alike: ~33,000 cuts cost 36 s of a CI core)."""
    marks, near = [0, *ends, BLOCK_SIZE], 2 * HEADER_SIZE + 8
    return [size for size in range(ends[-1], -1, -1) if size % 61 == 0 or any(abs(size - m) <= near for m in marks)]


@pytest.mark.parametrize("layout", _LAYOUTS)
def test_a_journal_cut_at_any_boundary_or_inside_a_payload_returns_exactly_the_records_wholly_inside(journal, layout):
    payloads = [_payload(n, size) for n, size in enumerate(_LAYOUTS[layout])]
    ends = _write(journal, payloads)
    assert ends[2] < BLOCK_SIZE < ends[3]
    live, final = JournalReader(journal), JournalReader(journal)

    for size in _cuts(ends):
        os.truncate(journal, size)
        whole = [(payload, end) for payload, end in zip(payloads, ends, strict=True) if end <= size]
        last_end = whole[-1][1] if whole else 0
        live.offset = final.offset = 0
        skipped = final.skipped

        assert live.read() == whole, size
        assert live.offset == last_end
        assert final.read(final=True) == whole, size
        assert final.skipped - skipped == (1 if size > last_end else 0), size
        assert final.torn_tail_bytes == size - last_end and final.damaged == 0, size  # a tail, not damage
        assert final.offset == size


def test_a_corrupted_record_stops_a_live_read_and_a_final_one_resyncs_at_the_next_intact_record(journal):
    payloads = [_payload(n, 1000) for n in range(100)]
    ends = _write(journal, payloads)
    starts = [0, *ends[:-1]]
    with open(journal, "r+b") as file:
        file.seek(starts[10] + HEADER_SIZE + 500)
        file.write(b"\xff")

    records, reader = _read_all(journal)
    assert [payload for payload, _ in records] == payloads[:10]
    assert reader.offset == starts[10]
    assert JournalReader(journal, reader.offset).read() == []  # and stays stopped

    records, reader = _read_all(journal, final=True)
    # Only the damaged record is lost: leveldb's resync at the next block lost the rest of block 0 too.
    kept = [n for n in range(100) if n != 10]
    assert [_intact(payload) for payload, _ in records] == kept
    assert [end for _, end in records] == [ends[n] for n in kept]
    assert reader.skipped == reader.damaged == 1
    assert reader.skipped_bytes == reader.damaged_bytes == starts[11] - starts[10]
    assert reader.damaged_at == starts[10]
    assert reader.torn_tail_bytes == 0
    assert reader.offset == journal.stat().st_size


def test_garbage_over_records_loses_only_the_records_it_touches(journal):
    """A range overwritten in the middle of the journal (2,000 bytes, across a block's boundary):
    every record it does not touch is read, whichever block it is in; it counts as damage, not as a
    torn tail."""
    payloads = [_payload(n, 700) for n in range(150)]
    ends = _write(journal, payloads)
    starts = [0, *ends[:-1]]
    begin, end = BLOCK_SIZE - 900, BLOCK_SIZE + 1100
    with open(journal, "r+b") as file:
        file.seek(begin)
        file.write(random.Random(7).randbytes(end - begin))
    touched = [n for n in range(150) if starts[n] < end and ends[n] > begin]

    records, reader = _read_all(journal, final=True)
    assert [_intact(payload) for payload, _ in records] == [n for n in range(150) if n not in touched]
    assert reader.damaged == 1 and reader.torn_tail_bytes == 0
    assert reader.damaged_at == starts[touched[0]]


def test_a_fragmented_record_with_a_corrupted_middle_is_never_returned(journal):
    payloads = [_payload(0, 100), _payload(1, 100_000), *[_payload(n, 100) for n in range(2, 6)]]
    ends = _write(journal, payloads)
    with open(journal, "r+b") as file:
        file.seek(BLOCK_SIZE + HEADER_SIZE + 1000)  # inside record 1's first MIDDLE fragment
        file.write(b"\xff")

    records, _ = _read_all(journal)
    assert [payload for payload, _ in records] == payloads[:1]

    records, reader = _read_all(journal, final=True)
    assert [payload for payload, _ in records] == [payloads[0], *payloads[2:]]
    assert [end for _, end in records] == [ends[0], *ends[2:]]
    assert reader.skipped == 1  # the record, its fragments in the blocks after included


def test_a_record_a_dead_writer_left_without_its_last_fragment_is_skipped_whole(journal):
    ends = _write(journal, [b"before"])
    torn = frame(ends[0], _payload(1, 50_000))
    with open(journal, "ab") as file:  # its first fragment only (to the end of block 0): then killed
        file.write(torn[: BLOCK_SIZE - ends[0]])
    _write(journal, [b"after"])  # a writer that goes on from the file's end

    records, reader = _read_all(journal)
    assert [payload for payload, _ in records] == [b"before"]
    assert reader.offset == ends[0]

    records, reader = _read_all(journal, final=True)
    assert [payload for payload, _ in records] == [b"before", b"after"]
    assert reader.skipped == 1
    assert reader.skipped_bytes == BLOCK_SIZE - ends[0]


def test_a_reserved_range_still_zeros_stops_a_live_read_until_it_is_written(journal):
    writer = JournalWriter(journal)
    writer.append(b"A")
    # What a thread does between reserving its range and writing it: the end has moved on.
    hole_offset = writer.end
    hole = frame(hole_offset, b"B" * 300)
    writer._end += len(hole)
    writer.append(b"C")
    writer.append(_payload(9, 40_000))  # runs on into block 1
    writer.append(b"D")

    live = JournalReader(journal)
    assert [payload for payload, _ in live.read()] == [b"A"]
    assert live.offset == hole_offset
    assert live.read() == []

    records, reader = _read_all(journal, final=True)  # were the writer dead: the range alone is lost
    assert [payload for payload, _ in records] == [b"A", b"C", _payload(9, 40_000), b"D"]
    assert reader.skipped == reader.damaged == 1

    with open(journal, "r+b") as file:  # the thread writes its range
        file.seek(hole_offset)
        file.write(hole)
    assert [payload for payload, _ in live.read()] == [b"B" * 300, b"C", _payload(9, 40_000), b"D"]
    assert live.offset == journal.stat().st_size
    assert live.skipped == 0
    writer.close()


# --- tailing -------------------------------------------------------------------------------------


def test_a_tailing_reader_returns_only_what_was_appended_since(journal):
    writer = JournalWriter(journal)
    reader = JournalReader(journal)
    assert reader.read() == []
    for n in range(3):
        writer.append(_payload(n, 50))
    first = reader.read()
    assert [_intact(payload) for payload, _ in first] == [0, 1, 2]

    for n in range(3, 6):
        writer.append(_payload(n, 20_000))
    assert [_intact(payload) for payload, _ in reader.read(limit=2)] == [3, 4]
    assert [_intact(payload) for payload, _ in reader.read()] == [5]
    assert reader.read() == []
    assert reader.offset == writer.end

    cursor = first[1][1]  # a consumer delivered records 0 and 1, then restarted
    records, _ = _read_all(journal, offset=cursor)
    assert [_intact(payload) for payload, _ in records] == [2, 3, 4, 5]
    writer.close()
    reader.close()


def test_appends_from_8_threads_are_each_read_once_and_intact_while_being_tailed(journal):
    writer = JournalWriter(journal)
    threads, per_thread = 8, 2000
    seen: list[bytes] = []
    tail_skipped: list[int] = []
    writing = threading.Event()
    writing.set()

    def append(thread: int) -> None:
        for i in range(per_thread):
            number = thread * per_thread + i
            writer.append(_payload(number, 5000 if i % 97 == 0 else 40 + i % 60))

    def tail() -> None:  # a live reader meanwhile: it must never return a half-written record
        with JournalReader(journal) as reader:
            while writing.is_set():
                seen.extend(payload for payload, _ in reader.read())
            seen.extend(payload for payload, _ in reader.read())
            tail_skipped.append(reader.skipped)

    tailer = threading.Thread(target=tail)
    tailer.start()
    appenders = [threading.Thread(target=append, args=(n,)) for n in range(threads)]
    for thread in appenders:
        thread.start()
    for thread in appenders:
        thread.join()
    writing.clear()
    tailer.join()
    writer.close()

    assert sorted(_intact(payload) for payload in seen) == list(range(threads * per_thread))
    assert tail_skipped == [0]
    records, reader = _read_all(journal, final=True)
    assert sorted(_intact(payload) for payload, _ in records) == list(range(threads * per_thread))
    assert reader.skipped == 0
    assert reader.offset == journal.stat().st_size


_CHILD = """
import sys
from pathlib import Path
from otel_forge.journal import JournalWriter

def payload(number, size):
    head = b"%d:" % number
    return head + bytes((number + i) % 251 for i in range(max(0, size - len(head))))

writer = JournalWriter(Path(sys.argv[1]))
number = 0
while True:
    writer.append(payload(number, 3000 if number % 7 == 0 else 60))
    number += 1
"""


def test_a_writer_killed_in_its_loop_leaves_every_record_before_the_last_intact(journal):
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(journal)])
    try:
        deadline = time.monotonic() + 30
        while not journal.exists() or journal.stat().st_size < 4 * BLOCK_SIZE:
            assert time.monotonic() < deadline and child.poll() is None, "the child wrote nothing"
            time.sleep(0.01)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL

    records, reader = _read_all(journal, final=True)
    numbers = [_intact(payload) for payload, _ in records]
    assert len(numbers) > 0
    assert numbers == list(range(len(numbers)))
    assert reader.skipped <= 1
    assert reader.offset == journal.stat().st_size


# --- the writer ----------------------------------------------------------------------------------


def test_the_writer_creates_its_file_private_and_goes_on_from_its_end(journal):
    ends = _write(journal, [b"one"])
    assert stat.S_IMODE(journal.stat().st_mode) == 0o600
    with JournalWriter(journal) as writer:
        assert writer.end == ends[0]
        assert writer.path == journal
        writer.append(b"two")
        writer.sync()
    records, _ = _read_all(journal)
    assert [payload for payload, _ in records] == [b"one", b"two"]


def test_a_closed_writer_refuses_to_append(journal):
    writer = JournalWriter(journal)
    writer.close()
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.append(b"late")


def test_a_forked_child_cannot_append_to_its_parents_journal(journal):
    writer = JournalWriter(journal)
    writer.append(b"parent")
    pid = os.fork()
    if pid == 0:  # the child: its appends would overwrite the parent's
        try:
            writer.append(b"child")
        except ValueError:
            os._exit(0)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    writer.append(b"parent again")
    writer.close()
    records, _ = _read_all(journal)
    assert [payload for payload, _ in records] == [b"parent", b"parent again"]


# --- which worker failed a launcher's job (worker_ends) -----------------------------------------------


def test_a_workers_failure_record_names_the_first_failure_of_the_last_attempt(tmp_path) -> None:
    from otel_forge.mlflow.training.worker_ends import ENDS_DIR, UNKNOWN_WORKER, take_failed_worker

    assert take_failed_worker(tmp_path) == UNKNOWN_WORKER
    ends = tmp_path / ENDS_DIR
    ends.mkdir()
    records = [(0, 3, 10.0), (1, 2, 30.0), (1, 5, 20.0)]  # (attempt, rank, time): attempt 1 is torchrun's last
    for attempt, rank, at in records:
        (ends / f"{attempt}-{rank}.json").write_text(json.dumps({"rank": rank, "attempt": attempt, "time": at}))
    (ends / "1-9.json").write_text("{half a reco")
    assert take_failed_worker(tmp_path) == "rank 5"
    assert not [p for p in ends.glob("*.json") if p.name != "1-9.json"]  # read once


def test_a_worker_records_its_uncaught_exception_and_python_still_reports_it(tmp_path) -> None:
    from otel_forge.mlflow.training.worker_ends import take_failed_worker

    code = "from otel_forge.mlflow.training.worker_ends import install_failure_record as i; i(); raise KeyError('x')"
    env = {"RANK": "3", "OTEL_FORGE_SPOOL_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "KeyError: 'x'" in result.stderr
    assert take_failed_worker(tmp_path) == "rank 3"


@pytest.fixture
def full_disk(tmp_path):
    from testkit.small_disk import can_mount, small_disk

    if not can_mount():
        pytest.skip("mounting a small tmpfs needs root")
    with small_disk(tmp_path / "disk") as disk:
        yield disk


def test_a_disk_that_fills_then_frees_leaves_no_hole_every_kept_record_is_read(full_disk):
    """Appends fail while the disk is full and succeed once space is freed: a live read (the writer
    still writing) and a final one both return every record whose append returned, in order; the
    failed ones leave nothing (before: a hole where a live read waited for ever, and a final read
    resynced at the next block, losing the records there)."""
    from testkit.small_disk import fill

    path = full_disk / "journal.log"
    kept, failed = [], 0
    with JournalWriter(path) as writer:
        for number in range(50):
            writer.append(b"before %d " % number + b"x" * 200)
            kept.append(b"before %d " % number + b"x" * 200)
        filler = fill(full_disk)
        for number in range(200):
            payload = b"full %d " % number + b"y" * 300
            try:
                writer.append(payload)
                kept.append(payload)
            except OSError:
                failed += 1
        filler.unlink()
        for number in range(50):
            writer.append(b"after %d " % number + b"z" * 200)
            kept.append(b"after %d " % number + b"z" * 200)
        live, _ = _read_all(path)
        assert [payload for payload, _ in live] == kept
    assert failed > 150
    final, reader = _read_all(path, final=True)
    assert [payload for payload, _ in final] == kept
    assert reader.skipped == 0


def test_a_failed_write_with_a_later_range_reserved_is_filled_with_a_gap_record(journal, monkeypatch):
    """Another thread reserved the range after the one whose write failed: the failed range cannot
    be given back, so the next append fills it with a gap record, and readers pass over it."""
    import errno

    from otel_forge.journal import writer as writer_module

    real_write = writer_module._write_at
    with JournalWriter(journal) as writer:
        writer.append(b"first")

        def failing_write(fd, data, offset):
            monkeypatch.setattr(writer_module, "_write_at", real_write)
            writer.append(b"reserved after it, written at once")  # another thread's, meanwhile
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(writer_module, "_write_at", failing_write)
        with pytest.raises(OSError):
            writer.append(b'["m",1,0,{"lost":1.0}]')
        live, _ = _read_all(journal)
        assert [payload for payload, _ in live] == [b"first"]  # the hole: a live read waits there
        writer.append(b"last")
        live, _ = _read_all(journal)
    payloads = [payload for payload, _ in live]
    assert payloads[0] == b"first" and json.loads(payloads[1]) == ["gap"]
    assert payloads[2:] == [b"reserved after it, written at once", b"last"]
