//! `replayguard consume`: the guarded consumer (G2), printing each fresh
//! record and acking it once it is written.

use std::io::{ErrorKind, IsTerminal, Write};
use std::sync::Arc;
use std::time::Duration;

use replayguard::kafka::GuardedConsumer;

use crate::cli::ConsumeArgs;
use crate::common::{self, Failure, Stop};
use crate::endpoint::{self, Ops};
use crate::progress::Progress;

/// How the read loop ended.
enum End {
    /// A stop, the end of the input, or a closed stdout: checkpoint.
    Clean,
    /// stdout failed otherwise: checkpoint what was written, then fail.
    Output(std::io::Error),
    /// The guard failed: leave its state as it is.
    Guard(replayguard::Error),
}

pub async fn run(args: ConsumeArgs) -> Result<(), Failure> {
    let g = &args.guard;
    common::check_properties(g)?;
    common::check_state(&g.state, replayguard::FolderUse::Run)?;
    let bound = g.metrics_addr.as_deref().map(endpoint::bind).transpose()?;
    let mut builder =
        GuardedConsumer::builder(common::consumer_config(g), &g.state).options(g.options());
    for topic in &args.topic {
        builder = builder.topic(topic);
    }
    let stop = Stop::install()?;
    let mut ops = Ops::start(bound, g.checkpoint_interval, g.metrics_linger)?;
    let consumer = match common::start(builder.build(), &stop).await {
        Ok(Some(consumer)) => Arc::new(consumer),
        Ok(None) => return ops.end(Ok(()), &stop).await,
        Err(failure) => return ops.end(Err(failure), &stop).await,
    };
    let watched = consumer.clone();
    ops.running(move || watched.stats().checkpoints);
    // Records on the same terminal would break the progress line.
    let watched = consumer.clone();
    let progress = Progress::start(!std::io::stdout().is_terminal(), false, move || {
        watched.stats().into()
    });

    let mut stopped = std::pin::pin!(ops.stopping_on(stop.wait()));
    let mut stdout = std::io::stdout();
    let mut line = Vec::new();
    let end = loop {
        let next = tokio::select! {
            biased;
            () = &mut stopped => break End::Clean,
            next = consumer.recv() => next,
        };
        let record = match next {
            Ok(Some(record)) => record,
            Ok(None) => break End::Clean,
            Err(e) => break End::Guard(e),
        };
        line.clear();
        args.format.render(record.message(), &mut line);
        // Acked only once written: a record lost in a failed write is
        // delivered again by the next run.
        match stdout.write_all(&line).and_then(|()| stdout.flush()) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::BrokenPipe => {
                tracing::info!("stdout closed; stopping");
                break End::Clean;
            }
            Err(e) => break End::Output(e),
        }
        match consumer.ack(&record) {
            Ok(()) => {}
            // Printed, but its partition moved since: its owner prints it
            // again, which the output cannot take back.
            Err(e @ replayguard::Error::Revoked { .. }) => {
                tracing::warn!(error = %e, "a printed record is printed again by its partition's owner");
            }
            Err(e) => break End::Guard(e),
        }
    };
    if matches!(end, End::Clean | End::Output(_)) {
        ops.stopping();
    }
    let result = match end {
        End::Clean => consumer.checkpoint().await.map_err(Failure::from),
        End::Output(e) => {
            let failure = Failure::runtime(format!(
                "writing to stdout failed: {e}; the records not written are delivered again by the next run"
            ));
            match consumer.checkpoint().await {
                Ok(()) => Err(failure),
                Err(cp) => Err(Failure::runtime(format!("{}; then {cp}", failure.message))),
            }
        }
        End::Guard(e) => Err(Failure::from(e)),
    };
    ops.finished(&result).await;
    progress.finish(consumer.stats().into()).await;
    // The progress line's handle is gone with it; if not, the consumer
    // closes when the process exits, which is as safe as a crash.
    if let Ok(consumer) = Arc::try_unwrap(consumer) {
        common::close(consumer.close(Duration::from_secs(10))).await;
    }
    ops.linger(&stop).await;
    result
}
