#!/usr/bin/env python3
"""Write test records into a Kafka topic with a client that is not ours.

    .venv/bin/python scripts/kafka_write.py --brokers 127.0.0.1:9092 \
        --topic in --client kafka-python --compression zstd --first 1 --count 250

Writes the integers first..first+count-1, key and value their decimal text,
with the producer compression named (none, gzip, snappy, lz4, zstd), in
batches, and waits for every ack. --property KEY=VALUE (repeatable) passes a
client property through (librdkafka names for confluent-kafka).

Exit codes: 0 every record acked, 1 a Kafka error, 2 usage error.
"""

import argparse
import sys


def write_confluent(args):
    from confluent_kafka import Producer

    conf = {
        "bootstrap.servers": args.brokers,
        "compression.type": args.compression,
        "enable.idempotence": True,
        "linger.ms": 20,
    }
    conf.update(dict(p.split("=", 1) for p in args.property))
    producer = Producer(conf)
    failures = []

    def acked(err, _msg):
        if err is not None:
            failures.append(str(err))

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
    args = parser.parse_args()
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
