#!/usr/bin/env python3
"""Read a Kafka topic with a client that is not ours, for checking output.

The tests run it with the virtualenv's python (scripts/test makes `.venv`):

    .venv/bin/python scripts/kafka_read.py --brokers 127.0.0.1:9092 \
        --topic output --client kafka-python

It reads every partition from the beginning, by manual assignment (it joins
no group and commits nothing), and stops:

  --until end   (default) when every partition reached the end offset it had
                at start (the high watermark, or the last stable offset under
                read_committed); records written later are not printed;
  --until idle  when no record arrived for --idle seconds.

Either way it gives up after --timeout seconds with exit code 3.

Output: one JSON object a line per record, in the order received:
  {"partition": 0, "offset": 5, "timestamp": 1700000000000,
   "key": "text" | null, "value": "text" | null,
   "headers": [{"key": "name", "value": "text" | null}]}
A key, value or header value that is not valid UTF-8 is given as base64
under "key_b64", "value_b64" or a header's "value_b64" instead.
With --summary only one JSON object is printed, with per-partition counts and
offset ranges and the number of distinct and duplicated values.

--committed GROUP prints, instead of records, one JSON object a line with the
offset GROUP has committed for each partition ("committed": null if none).

Exit codes: 0 done, 1 Kafka or topic error, 2 usage error, 3 timed out.
confluent-kafka works with both test brokers; kafka-python cannot bootstrap
against librdkafka's mock cluster.
"""

import argparse
import base64
import json
import signal
import sys
import time
import uuid


class ReadError(Exception):
    """A failure to report on stderr with exit code 1."""


class TimedOut(Exception):
    """The read did not finish within --timeout (exit code 3)."""


def encode_bytes(obj, name, data):
    """Store data under obj[name] as text, or under obj[name_b64] as base64."""
    if data is None:
        obj[name] = None
        return
    if isinstance(data, str):
        obj[name] = data
        return
    try:
        obj[name] = bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        obj[name + "_b64"] = base64.b64encode(bytes(data)).decode("ascii")


def record_json(partition, offset, timestamp, key, value, headers):
    rec = {"partition": partition, "offset": offset, "timestamp": timestamp}
    encode_bytes(rec, "key", key)
    encode_bytes(rec, "value", value)
    hdrs = []
    for hkey, hvalue in headers or []:
        h = {"key": hkey}
        encode_bytes(h, "value", hvalue)
        hdrs.append(h)
    rec["headers"] = hdrs
    return rec


class Confluent:
    def __init__(self, args, group=None):
        from confluent_kafka import Consumer

        self.topic = args.topic
        self.timeout = args.request_timeout
        self.consumer = Consumer(
            {
                "bootstrap.servers": args.brokers,
                # Required by the client; the reader assigns partitions by
                # hand, so it never joins this group or commits to it.
                "group.id": group or "kafka-read-" + uuid.uuid4().hex,
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
                "isolation.level": args.isolation,
                "enable.partition.eof": False,
                "error_cb": self._on_error,
            }
        )
        self.fatal = None

    def _on_error(self, err):
        # Transient connection errors are retried by librdkafka; only a fatal
        # error, or an all-brokers-down that lasts, ends the read.
        if err.fatal():
            self.fatal = err

    def partitions(self):
        md = self.consumer.list_topics(self.topic, timeout=self.timeout)
        t = md.topics.get(self.topic)
        if t is None:
            raise ReadError(f"topic {self.topic!r} is not in the metadata")
        if t.error is not None:
            raise ReadError(f"topic {self.topic!r}: {t.error.str()}")
        if not t.partitions:
            raise ReadError(f"topic {self.topic!r} has no partitions")
        return sorted(t.partitions)

    def end_offsets(self, partitions):
        from confluent_kafka import TopicPartition

        ends = {}
        for p in partitions:
            # Queries the broker, honouring isolation.level (ListOffsets).
            _low, high = self.consumer.get_watermark_offsets(
                TopicPartition(self.topic, p), timeout=self.timeout, cached=False
            )
            ends[p] = high
        return ends

    def assign_from_beginning(self, partitions):
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        self.consumer.assign(
            [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in partitions]
        )

    def poll(self):
        from confluent_kafka import KafkaError

        if self.fatal is not None:
            raise ReadError(f"fatal client error: {self.fatal.str()}")
        out = []
        for m in self.consumer.consume(num_messages=1000, timeout=0.5):
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                raise ReadError(f"consume failed: {err.str()}")
            _ts_type, ts = m.timestamp()
            out.append(
                record_json(
                    m.partition(), m.offset(), ts, m.key(), m.value(), m.headers()
                )
            )
        return out

    def position(self, partition):
        from confluent_kafka import TopicPartition

        [tp] = self.consumer.position([TopicPartition(self.topic, partition)])
        return tp.offset  # negative (OFFSET_INVALID) when unknown

    def committed(self, partitions):
        from confluent_kafka import TopicPartition

        tps = self.consumer.committed(
            [TopicPartition(self.topic, p) for p in partitions], timeout=self.timeout
        )
        result = {}
        for tp in tps:
            if tp.error is not None:
                raise ReadError(f"committed offsets: {tp.error.str()}")
            result[tp.partition] = tp.offset if tp.offset >= 0 else None
        return result

    def close(self):
        self.consumer.close()


class KafkaPython:
    def __init__(self, args, group=None):
        from kafka import KafkaConsumer

        self.topic = args.topic
        timeout_ms = int(args.request_timeout * 1000)
        self.timeout_ms = timeout_ms
        self.consumer = KafkaConsumer(
            bootstrap_servers=args.brokers.split(","),
            group_id=group,
            client_id="kafka-read",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level=args.isolation,
            request_timeout_ms=max(timeout_ms, 5000),
            bootstrap_timeout_ms=timeout_ms,
        )

    def partitions(self):
        # Asks the cluster when the metadata cache does not know the topic.
        parts = self.consumer.partitions_for_topic(self.topic)
        if not parts:
            raise ReadError(f"topic {self.topic!r} is not in the metadata")
        return sorted(parts)

    def _tps(self, partitions):
        from kafka import TopicPartition

        return [TopicPartition(self.topic, p) for p in partitions]

    def end_offsets(self, partitions):
        ends = self.consumer.end_offsets(self._tps(partitions), self.timeout_ms)
        return {tp.partition: off for tp, off in ends.items()}

    def assign_from_beginning(self, partitions):
        tps = self._tps(partitions)
        self.consumer.assign(tps)
        self.consumer.seek_to_beginning(*tps)

    def poll(self):
        out = []
        batches = self.consumer.poll(timeout_ms=500, max_records=1000)
        for tp, records in batches.items():
            for r in records:
                out.append(
                    record_json(
                        tp.partition, r.offset, r.timestamp, r.key, r.value, r.headers
                    )
                )
        return out

    def position(self, partition):
        from kafka import TopicPartition

        pos = self.consumer.position(TopicPartition(self.topic, partition))
        return -1 if pos is None else pos

    def committed(self, partitions):
        result = {}
        for tp in self._tps(partitions):
            off = self.consumer.committed(tp, timeout_ms=self.timeout_ms)
            result[tp.partition] = off
        return result

    def close(self):
        self.consumer.close()


def read(client, args, emit):
    partitions = client.partitions()
    ends = client.end_offsets(partitions) if args.until == "end" else None
    client.assign_from_beginning(partitions)
    deadline = time.monotonic() + args.timeout
    last_record = time.monotonic()
    next_offset = {p: 0 for p in partitions}

    def done():
        if args.until == "idle":
            return time.monotonic() - last_record >= args.idle
        for p in partitions:
            if next_offset[p] >= ends[p]:
                continue
            # Control records (transaction markers) are skipped by the
            # client, so the position can pass offsets that no record had.
            if client.position(p) < ends[p]:
                return False
            next_offset[p] = ends[p]
        return True

    while not done():
        if time.monotonic() > deadline:
            if args.until == "end":
                behind = {
                    p: {"next": next_offset[p], "end": ends[p]}
                    for p in partitions
                    if next_offset[p] < ends[p]
                }
                raise TimedOut(
                    f"not at the end after {args.timeout}s; behind: {json.dumps(behind)}"
                )
            raise TimedOut(f"records still arriving after {args.timeout}s")
        for rec in client.poll():
            p, off = rec["partition"], rec["offset"]
            if ends is not None and off >= ends[p]:
                continue
            next_offset[p] = max(next_offset[p], off + 1)
            last_record = time.monotonic()
            emit(rec)
    return partitions, ends


class Summary:
    def __init__(self):
        self.records = 0
        self.partitions = {}
        self.value_counts = {}

    def add(self, rec):
        self.records += 1
        part = self.partitions.setdefault(
            str(rec["partition"]),
            {"count": 0, "first_offset": None, "last_offset": None},
        )
        part["count"] += 1
        if part["first_offset"] is None:
            part["first_offset"] = rec["offset"]
        part["last_offset"] = rec["offset"]
        value = rec.get("value", rec.get("value_b64"))
        self.value_counts[value] = self.value_counts.get(value, 0) + 1

    def to_json(self, ends):
        out = {
            "records": self.records,
            "partitions": self.partitions,
            "distinct_values": len(self.value_counts),
            "duplicated_values": sum(1 for c in self.value_counts.values() if c > 1),
        }
        if ends is not None:
            out["end_offsets"] = {str(p): e for p, e in ends.items()}
        return out


def main():
    ap = argparse.ArgumentParser(
        description="Read a Kafka topic with an independent client and print JSON lines."
    )
    ap.add_argument("--brokers", required=True, help="bootstrap list host:port[,...]")
    ap.add_argument("--topic", required=True)
    ap.add_argument("--client", choices=["confluent", "kafka-python"], default="confluent")
    ap.add_argument(
        "--isolation",
        choices=["read_committed", "read_uncommitted"],
        default="read_uncommitted",
    )
    ap.add_argument("--until", choices=["end", "idle"], default="end")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds without records (--until idle)")
    ap.add_argument("--timeout", type=float, default=60.0, help="give up after this many seconds")
    ap.add_argument(
        "--request-timeout", type=float, default=15.0, help="seconds for one metadata or offsets request"
    )
    ap.add_argument("--summary", action="store_true", help="print one summary object instead of records")
    ap.add_argument("--committed", metavar="GROUP", help="print GROUP's committed offsets instead")
    args = ap.parse_args()
    if args.timeout <= 0 or args.idle <= 0 or args.request_timeout <= 0:
        ap.error("--timeout, --idle and --request-timeout must be positive")

    kind = Confluent if args.client == "confluent" else KafkaPython
    client = None

    # A hard bound, for calls that block past their own timeouts (a client
    # that cannot bootstrap, a broker that stops answering).
    def on_alarm(_signum, _frame):
        raise TimedOut(f"gave up after {hard_limit}s in all")

    hard_limit = int(args.timeout + 3 * args.request_timeout) + 1
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(hard_limit)
    try:
        client = kind(args, group=args.committed)
        if args.committed is not None:
            for p, off in sorted(client.committed(client.partitions()).items()):
                print(json.dumps({"partition": p, "committed": off}))
            return 0
        summary = Summary()
        if args.summary:
            emit = summary.add
        else:
            def emit(rec):
                print(json.dumps(rec, separators=(",", ":")))
        _partitions, ends = read(client, args, emit)
        if args.summary:
            print(json.dumps(summary.to_json(ends)))
        return 0
    except TimedOut as e:
        print(f"kafka_read: timed out: {e}", file=sys.stderr)
        return 3
    except ReadError as e:
        print(f"kafka_read: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a client library error: say which, not a traceback
        print(f"kafka_read: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            pass
        if client is not None:
            try:
                client.close()
            except Exception:
                pass


if __name__ == "__main__":
    sys.exit(main())
