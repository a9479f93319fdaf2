#!/usr/bin/env python3
"""Small Kafka helpers for measuring the Flink peer (confluent-kafka).

  kt.py produce --brokers B --topic T --count N [--every-ms 100] [--start 1]
        [--log FILE] [--size BYTES]
      Writes the integers start..start+N-1 as ASCII values (key = the same),
      one every --every-ms (0: as fast as possible). With --log, appends
      "i <unix time of the delivery ack>" per integer. --size pads the
      value with spaces after the digits to that many bytes.

  kt.py read --brokers B --topic T --log FILE [--until N] [--idle-s S]
      read_committed reader from the beginning (no group). Appends
      "i <unix time received>" per record to FILE, flushing each line.
      Stops after seeing value N, or after S seconds without a record.

  kt.py check --expect N --read FILE [--written FILE] [--after T0]
      Counts duplicates and missing integers 1..N in what was read, and, with
      --written, the write-to-read latency p50/p99/max (first read of each).
      --after T0 [--since T1] also prints the first record read after T1
      (default T0), as seconds after T0: T0 the kill, T1 the restart.
"""
import argparse
import sys
import time

from confluent_kafka import Consumer, Producer, TopicPartition, OFFSET_BEGINNING


def produce(a):
    p = Producer({"bootstrap.servers": a.brokers, "enable.idempotence": True,
                  "linger.ms": 0 if a.every_ms else 5})
    log = open(a.log, "a", buffering=1) if a.log else None

    def ack(err, msg):
        if err is not None:
            sys.exit(f"produce failed: {err}")
        if log:
            log.write(f"{int(msg.key())} {time.time():.6f}\n")

    t0 = time.monotonic()
    for k in range(a.count):
        i = a.start + k
        v = str(i).encode()
        if a.size:
            v = v.ljust(a.size, b" ")
        while True:
            try:
                p.produce(a.topic, key=str(i).encode(), value=v, on_delivery=ack)
                break
            except BufferError:
                p.poll(0.05)
        if a.every_ms:
            p.flush()
            nxt = t0 + (k + 1) * a.every_ms / 1000.0
            d = nxt - time.monotonic()
            if d > 0:
                time.sleep(d)
        else:
            p.poll(0)
    p.flush()


def read(a):
    c = Consumer({"bootstrap.servers": a.brokers, "group.id": "kt-reader-unused",
                  "enable.auto.commit": False, "isolation.level": "read_committed",
                  "fetch.wait.max.ms": 10})
    c.assign([TopicPartition(a.topic, 0, OFFSET_BEGINNING)])
    log = open(a.log, "a", buffering=1)
    last = time.monotonic()
    while True:
        msgs = c.consume(1000, 0.05)
        now = time.time()
        for m in msgs:
            if m.error():
                continue
            i = int(m.value().split(b" ", 1)[0])
            log.write(f"{i} {now:.6f}\n")
            last = time.monotonic()
            if a.until and i == a.until:
                c.close()
                return
        if time.monotonic() - last > a.idle_s:
            break
    c.close()


def load(path):
    out = []
    with open(path) as f:
        for line in f:
            i, t = line.split()
            out.append((int(i), float(t)))
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def check(a):
    got = load(a.read)
    seen = {}
    dup = 0
    for i, t in got:
        if i in seen:
            dup += 1
        else:
            seen[i] = t
    missing = [i for i in range(1, a.expect + 1) if i not in seen]
    order_breaks = sum(1 for x, y in zip(got, got[1:]) if y[0] <= x[0])
    print(f"read={len(got)} distinct={len(seen)} duplicates={dup} "
          f"missing={len(missing)} order_breaks={order_breaks}")
    if missing[:10]:
        print("first missing:", missing[:10])
    if a.written:
        w = dict(load(a.written))
        lat = [(seen[i] - w[i]) * 1000 for i in seen if i in w]
        if lat:
            print(f"latency_ms p50={pct(lat, .5):.0f} p99={pct(lat, .99):.0f} "
                  f"max={max(lat):.0f} n={len(lat)}")
    if a.after:
        since = a.since or a.after
        later = [(t, i) for i, t in got if t > since]
        if later:
            t, i = min(later)
            print(f"first read after the restart: value={i}, {t - a.after:.2f} s after the kill")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("produce")
    p.add_argument("--brokers", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--start", type=int, default=1)
    p.add_argument("--every-ms", type=float, default=100)
    p.add_argument("--size", type=int, default=0)
    p.add_argument("--log")
    r = sub.add_parser("read")
    r.add_argument("--brokers", required=True)
    r.add_argument("--topic", required=True)
    r.add_argument("--log", required=True)
    r.add_argument("--until", type=int)
    r.add_argument("--idle-s", type=float, default=60)
    c = sub.add_parser("check")
    c.add_argument("--expect", type=int, required=True)
    c.add_argument("--read", required=True)
    c.add_argument("--written")
    c.add_argument("--after", type=float)
    c.add_argument("--since", type=float)
    a = ap.parse_args()
    {"produce": produce, "read": read, "check": check}[a.cmd](a)


if __name__ == "__main__":
    main()
