"""A producer of synthetic Criteo events into a Redis stream, for demos, tests and benchmarks:
``python -m paramserver.streams.produce redis://HOST:PORT/STREAM --records N [--rate R]``.

Each entry's field ``line`` holds one line of :func:`paramserver.data.criteo.write_synthetic_criteo`
(the same lines as a file written with the same ``--seed``), and ``--record-ids`` puts the
record's number (0, 1, ...) in hex in categorical column C26 instead: every record then looks
up a row of its own, which counts how often it was trained on. ``--rate`` paces the
records per second (default: as fast as Redis takes them).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Sequence

from paramserver.data.criteo import synthetic_criteo_chunks
from paramserver.streams.redis import RedisStream

PIPELINE = 1000  # XADDs sent together


def synthetic_lines(
    records: int | None, seed: int = 0, record_ids: bool = False, first_id: int = 0
) -> Iterator[bytes]:
    """The producer's lines (without their endings)."""
    number = first_id
    for chunk in synthetic_criteo_chunks(records, seed=seed):
        for line in chunk.splitlines():
            if record_ids:
                line = line[: line.rindex(b"\t") + 1] + b"%x" % number
            number += 1
            yield line


def produce(source: RedisStream, lines: Iterator[bytes], rate: float | None = None) -> int:
    """XADD every line to the stream (field ``source.record_field``), paced at ``rate`` per
    second if given; returns the number written."""
    client = source.connect()
    started, written = time.monotonic(), 0
    pipe = client.pipeline(transaction=False)
    for line in lines:
        pipe.xadd(source.stream, {source.record_field: line})
        written += 1
        if written % PIPELINE == 0:
            pipe.execute()
            if rate:
                ahead = written / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
    pipe.execute()
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paramserver.streams.produce")
    parser.add_argument("url", help="redis://HOST:PORT/STREAM")
    parser.add_argument("--records", type=int, default=100_000, help="0: without end")
    parser.add_argument("--rate", type=float, help="records per second (default: at once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record-ids", action="store_true", help="C26 = the record's number")
    parser.add_argument("--first-id", type=int, default=0, help="the first record's number")
    args = parser.parse_args(argv)
    source = RedisStream.from_url(args.url)
    lines = synthetic_lines(args.records or None, args.seed, args.record_ids, args.first_id)
    written = produce(source, lines, args.rate)
    print(f"wrote {written} records to {source.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
