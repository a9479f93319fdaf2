#!/usr/bin/env python3
"""Write test records into a Kafka topic with a client that is not ours.

    .venv/bin/python scripts/kafka_write.py --brokers 127.0.0.1:9092 \
        --topic in --client kafka-python --compression zstd --first 1 --count 250

Writes the integers first..first+count-1, key and value their decimal text,
with the producer compression named (none, gzip, snappy, lz4, zstd), in
batches, and waits for every ack. --property KEY=VALUE (repeatable) passes a
client property through (librdkafka names for confluent-kafka).

--transactions N (confluent-kafka only) writes them in Kafka transactions
of N records, committed; with --aborted, each committed transaction is
followed by one of as many records that is aborted, whose values are
1,000,000,000 more than those of the committed one before it, so a reader
that shows them is caught. A partition's log then ends with a transaction
marker, not a record.

Exit codes: 0 every record acked, 1 a Kafka error, 2 usage error.
"""

import argparse
import sys

ABORTED_OFFSET = 1_000_000_000


def write_confluent(args):
    from confluent_kafka import Producer

    conf = {
        "bootstrap.servers": args.brokers,
        "compression.type": args.compression,
        "enable.idempotence": True,
        "linger.ms": 20,
    }
    if args.transactions:
        conf["transactional.id"] = f"kafka_write-{args.topic}-{args.first}"
    conf.update(dict(p.split("=", 1) for p in args.property))
    producer = Producer(conf)
    failures = []

    def acked(err, _msg):
        if err is not None:
            failures.append(str(err))

    if args.transactions:
        producer.init_transactions(60)
        end = args.first + args.count
        for start in range(args.first, end, args.transactions):
            batch = range(start, min(start + args.transactions, end))
            producer.begin_transaction()
            for n in batch:
                text = str(n).encode()
                producer.produce(args.topic, key=text, value=text, on_delivery=acked)
            producer.commit_transaction(60)
            if args.aborted:
                producer.begin_transaction()
                for n in batch:
                    text = str(n + ABORTED_OFFSET).encode()
                    producer.produce(args.topic, key=text, value=text)
                producer.flush(60)
                producer.abort_transaction(60)
        if failures:
            raise SystemExit(f"kafka_write.py: {len(failures)} failed: {failures[:3]}")
        return

    for n in range(args.first, args.first + args.count):
        text = str(n).encode()
        while True:
            try:
                producer.produce(args.topic, key=text, value=text, on_delivery=acked)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    left = producer.flush(60)
    if left or failures:
        raise SystemExit(f"kafka_write.py: {left} unacked, {len(failures)} failed: {failures[:3]}")


def write_kafka_python(args):
    from kafka import KafkaProducer

    producer = KafkaProducer(
        bootstrap_servers=args.brokers,
        compression_type=None if args.compression == "none" else args.compression,
        linger_ms=20,
        acks="all",
    )
    futures = []
    for n in range(args.first, args.first + args.count):
        text = str(n).encode()
        futures.append(producer.send(args.topic, key=text, value=text))
    for f in futures:
        f.get(timeout=60)
    producer.close(timeout=30)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--brokers", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--client", choices=["confluent", "kafka-python"], default="confluent")
    parser.add_argument(
        "--compression", choices=["none", "gzip", "snappy", "lz4", "zstd"], default="none"
    )
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--property", action="append", default=[])
    parser.add_argument("--transactions", type=int, default=0, metavar="N")
    parser.add_argument("--aborted", action="store_true")
    args = parser.parse_args()
    if args.transactions < 0 or (args.transactions and args.client != "confluent"):
        parser.error("--transactions takes a positive size, with --client confluent")
    if args.aborted and not args.transactions:
        parser.error("--aborted needs --transactions")
    try:
        if args.client == "confluent":
            write_confluent(args)
        else:
            write_kafka_python(args)
    except SystemExit:
        raise
    except Exception as e:  # a Kafka error of either client
        print(f"kafka_write.py: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
