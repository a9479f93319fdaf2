package dev.replayguard.peer.flink;

import java.lang.management.ManagementFactory;
import java.time.Duration;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Optional;

import org.apache.flink.api.common.JobID;
import org.apache.flink.api.common.JobStatus;
import org.apache.flink.api.common.eventtime.WatermarkStrategy;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.configuration.CheckpointingOptions;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.ExternalizedCheckpointRetention;
import org.apache.flink.configuration.RestOptions;
import org.apache.flink.configuration.StateRecoveryOptions;
import org.apache.flink.connector.base.DeliveryGuarantee;
import org.apache.flink.connector.kafka.lineage.DefaultKafkaDatasetFacet;
import org.apache.flink.connector.kafka.lineage.DefaultKafkaDatasetIdentifier;
import org.apache.flink.connector.kafka.lineage.KafkaDatasetFacet;
import org.apache.flink.connector.kafka.lineage.KafkaDatasetFacetProvider;
import org.apache.flink.connector.kafka.sink.KafkaRecordSerializationSchema;
import org.apache.flink.connector.kafka.sink.KafkaSink;
import org.apache.flink.connector.kafka.sink.TransactionNamingStrategy;
import org.apache.flink.connector.kafka.source.KafkaSource;
import org.apache.flink.connector.kafka.source.enumerator.initializer.OffsetsInitializer;
import org.apache.flink.connector.kafka.source.reader.deserializer.KafkaRecordDeserializationSchema;
import org.apache.flink.core.execution.CheckpointingMode;
import org.apache.flink.runtime.execution.ExecutionState;
import org.apache.flink.runtime.executiongraph.AccessExecutionGraph;
import org.apache.flink.runtime.executiongraph.AccessExecutionVertex;
import org.apache.flink.runtime.jobgraph.SavepointRestoreSettings;
import org.apache.flink.runtime.jobmaster.JobResult;
import org.apache.flink.runtime.minicluster.MiniCluster;
import org.apache.flink.runtime.minicluster.MiniClusterConfiguration;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.graph.StreamGraph;
import org.apache.flink.util.Collector;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.OffsetResetStrategy;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;

/**
 * The seed's job as Flink 2.2 writes it: a KafkaSource reads one topic, a
 * KafkaSink writes every record (key and value as they are) to another, with
 * parallelism 1 and periodic checkpoints. With {@code EXACTLY_ONCE} the sink
 * writes inside Kafka transactions and commits them when a checkpoint
 * completes; with {@code AT_LEAST_ONCE} it writes plainly and flushes at each
 * checkpoint.
 *
 * <p>It runs on a local MiniCluster inside this JVM (one TaskManager, one
 * slot). When every task of the job is RUNNING (state restored, lingering
 * transactions aborted, operators open) it prints one line to stdout:
 *
 * <pre>flink-peer: running job=ID guarantee=G restored=PATH|none jvm_uptime_ms=N</pre>
 *
 * Everything else (Flink's logs) goes to stderr.
 */
public final class CopyJob {

    /** A record as read: key and value bytes, either may be null. A POJO, so nulls serialize. */
    public static final class Rec {
        public byte[] key;
        public byte[] value;

        public Rec() {}

        Rec(byte[] key, byte[] value) {
            this.key = key;
            this.value = value;
        }
    }

    static final class ReadBytes implements KafkaRecordDeserializationSchema<Rec> {
        @Override
        public void deserialize(ConsumerRecord<byte[], byte[]> record, Collector<Rec> out) {
            out.collect(new Rec(record.key(), record.value()));
        }

        @Override
        public TypeInformation<Rec> getProducedType() {
            return TypeInformation.of(Rec.class);
        }
    }

    /** Names its one topic, which the POOLING naming strategy requires to list transactions. */
    static final class WriteBytes
            implements KafkaRecordSerializationSchema<Rec>, KafkaDatasetFacetProvider {
        private final String topic;

        WriteBytes(String topic) {
            this.topic = topic;
        }

        @Override
        public ProducerRecord<byte[], byte[]> serialize(
                Rec element, KafkaSinkContext context, Long timestamp) {
            return new ProducerRecord<>(topic, null, timestamp, element.key, element.value);
        }

        @Override
        public Optional<KafkaDatasetFacet> getKafkaDatasetFacet() {
            return Optional.of(
                    new DefaultKafkaDatasetFacet(DefaultKafkaDatasetIdentifier.ofTopics(List.of(topic))));
        }
    }

    private static final String USAGE =
            "usage: CopyJob --brokers HOST:PORT --input TOPIC --output TOPIC --group ID\n"
                    + "       --checkpoint-dir DIR [--checkpoint-interval MS (20000)]\n"
                    + "       [--guarantee EXACTLY_ONCE|AT_LEAST_ONCE (EXACTLY_ONCE)]\n"
                    + "       [--transactional-id-prefix P (flink-peer-<group>)]\n"
                    + "       [--transaction-timeout-ms MS (600000)]\n"
                    + "       [--transaction-naming INCREMENTING|POOLING (INCREMENTING)]\n"
                    + "       [--restore PATH/chk-N]";

    public static void main(String[] args) throws Exception {
        Map<String, String> flags = parse(args);
        String brokers = required(flags, "brokers");
        String input = required(flags, "input");
        String output = required(flags, "output");
        String group = required(flags, "group");
        String checkpointDir = required(flags, "checkpoint-dir");
        long interval = Long.parseLong(flags.getOrDefault("checkpoint-interval", "20000"));
        DeliveryGuarantee guarantee =
                DeliveryGuarantee.valueOf(flags.getOrDefault("guarantee", "EXACTLY_ONCE"));
        String prefix = flags.getOrDefault("transactional-id-prefix", "flink-peer-" + group);
        String txTimeout = flags.getOrDefault("transaction-timeout-ms", "600000");
        TransactionNamingStrategy naming =
                TransactionNamingStrategy.valueOf(
                        flags.getOrDefault("transaction-naming", "INCREMENTING"));
        String restore = flags.get("restore");

        Configuration conf = new Configuration();
        conf.set(CheckpointingOptions.CHECKPOINTING_INTERVAL, Duration.ofMillis(interval));
        conf.set(CheckpointingOptions.CHECKPOINTING_CONSISTENCY_MODE, CheckpointingMode.EXACTLY_ONCE);
        conf.set(CheckpointingOptions.CHECKPOINT_STORAGE, "filesystem");
        conf.set(CheckpointingOptions.CHECKPOINTS_DIRECTORY, toUri(checkpointDir));
        conf.set(
                CheckpointingOptions.EXTERNALIZED_CHECKPOINT_RETENTION,
                ExternalizedCheckpointRetention.RETAIN_ON_CANCELLATION);
        if (restore != null) {
            conf.set(StateRecoveryOptions.SAVEPOINT_PATH, restore);
        }
        // No fixed REST port: two peers (or a peer and its restart) may overlap.
        conf.set(RestOptions.BIND_ADDRESS, "127.0.0.1");
        conf.set(RestOptions.ADDRESS, "127.0.0.1");
        conf.set(RestOptions.BIND_PORT, "0");

        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(1);

        KafkaSource<Rec> source =
                KafkaSource.<Rec>builder()
                        .setBootstrapServers(brokers)
                        .setTopics(input)
                        .setGroupId(group)
                        .setStartingOffsets(
                                OffsetsInitializer.committedOffsets(OffsetResetStrategy.EARLIEST))
                        .setDeserializer(new ReadBytes())
                        .build();

        KafkaSink<Rec> sink =
                KafkaSink.<Rec>builder()
                        .setBootstrapServers(brokers)
                        .setRecordSerializer(new WriteBytes(output))
                        .setDeliveryGuarantee(guarantee)
                        .setTransactionalIdPrefix(prefix)
                        .setTransactionNamingStrategy(naming)
                        // The sink's default is 1 h; the broker refuses more than
                        // transaction.max.timeout.ms (15 min by default).
                        .setProperty(ProducerConfig.TRANSACTION_TIMEOUT_CONFIG, txTimeout)
                        .build();

        env.fromSource(source, WatermarkStrategy.noWatermarks(), "kafka-in")
                .uid("kafka-in")
                .sinkTo(sink)
                .uid("kafka-out");

        StreamGraph graph = env.getStreamGraph();
        graph.setJobName("flink-peer copy " + input + " -> " + output);
        graph.setSavepointRestoreSettings(SavepointRestoreSettings.fromConfiguration(conf));

        MiniCluster cluster =
                new MiniCluster(
                        new MiniClusterConfiguration.Builder()
                                .setConfiguration(conf)
                                .setNumTaskManagers(1)
                                .setNumSlotsPerTaskManager(1)
                                .build());
        cluster.start();
        Runtime.getRuntime()
                .addShutdownHook(new Thread(() -> cluster.closeAsync().join(), "flink-peer-close"));

        JobID job = cluster.submitJob(graph).get().getJobID();
        waitUntilRunning(cluster, job);
        System.out.printf(
                "flink-peer: running job=%s guarantee=%s restored=%s jvm_uptime_ms=%d%n",
                job,
                guarantee.name(),
                restore == null ? "none" : restore,
                ManagementFactory.getRuntimeMXBean().getUptime());
        System.out.flush();

        JobResult result = cluster.requestJobResult(job).get();
        System.err.println("flink-peer: job ended: " + result.getApplicationStatus());
        if (result.getSerializedThrowable().isPresent()) {
            result.getSerializedThrowable().get().printStackTrace();
        }
        System.exit(result.isSuccess() ? 0 : 1);
    }

    /** Polls until every execution of the job is RUNNING; a job that ends first is an error. */
    private static void waitUntilRunning(MiniCluster cluster, JobID job) throws Exception {
        while (true) {
            AccessExecutionGraph graph = cluster.getExecutionGraph(job).get();
            if (graph.getState().isGloballyTerminalState()) {
                throw new IllegalStateException("job ended before it ran: " + graph.getState());
            }
            boolean running = graph.getState() == JobStatus.RUNNING;
            for (AccessExecutionVertex v : graph.getAllExecutionVertices()) {
                running &= v.getExecutionState() == ExecutionState.RUNNING;
            }
            if (running) {
                return;
            }
            Thread.sleep(20);
        }
    }

    private static String toUri(String dir) {
        return dir.contains("://") ? dir : new java.io.File(dir).getAbsoluteFile().toURI().toString();
    }

    private static Map<String, String> parse(String[] args) {
        Map<String, String> flags = new LinkedHashMap<>();
        for (int i = 0; i < args.length; i++) {
            String a = args[i];
            if (!a.startsWith("--") || i + 1 >= args.length) {
                fail("bad argument " + a);
            }
            flags.put(a.substring(2), args[++i]);
        }
        for (String k : flags.keySet()) {
            switch (k) {
                case "brokers", "input", "output", "group", "checkpoint-dir",
                        "checkpoint-interval", "guarantee", "transactional-id-prefix",
                        "transaction-timeout-ms", "transaction-naming", "restore" -> {}
                default -> fail("unknown flag --" + k);
            }
        }
        return flags;
    }

    private static String required(Map<String, String> flags, String name) {
        String v = flags.get(name);
        if (v == null) {
            fail("--" + name + " is required");
        }
        return v;
    }

    private static void fail(String why) {
        System.err.println("flink-peer: " + why + "\n" + USAGE);
        System.exit(2);
    }
}
