//! `replayguard pipe`: input topic to output topic through the guarded
//! pipeline (G1), or through a baseline to measure it against.

use std::convert::Infallible;
use std::time::Duration;

use rdkafka::message::OwnedMessage;
use replayguard::kafka::{GuardedPipeline, OutputRecord};

use crate::cli::{Mode, PipeArgs};
use crate::common::{self, Failure, Stop};
use crate::endpoint::{self, Ops};
use crate::progress::Progress;

pub async fn run(args: PipeArgs) -> Result<(), Failure> {
    let g = &args.guard;
    common::check_properties(g)?;
    common::check_state(&g.state, replayguard::FolderUse::Run)?;
    let bound = g.metrics_addr.as_deref().map(endpoint::bind).transpose()?;
    let mut builder = GuardedPipeline::builder(common::consumer_config(g), &g.state)
        .output(&args.output)
        .producer_config(common::producer_config(g))
        .delivery_timeout(args.delivery_timeout)
        .options(g.options());
    if let Mode::Baseline(b) = args.mode {
        builder = builder.baseline(b);
    }
    for input in &args.input {
        builder = builder.input(input);
    }
    let stop = Stop::install()?;
    let mut ops = Ops::start(bound, g.checkpoint_interval, g.metrics_linger)?;
    let mut pipeline = match common::start(builder.build(), &stop).await {
        Ok(Some(pipeline)) => pipeline,
        Ok(None) => return ops.end(Ok(()), &stop).await,
        Err(failure) => return ops.end(Err(failure), &stop).await,
    };
    let handle = pipeline.stats_handle();
    let watched = handle.clone();
    ops.running(move || watched.stats().checkpoints);
    let progress = Progress::start(true, true, move || handle.stats().into());
    let copy =
        |m: OwnedMessage| async move { Ok::<_, Infallible>(vec![OutputRecord::copy_of(&m)]) };
    let result = pipeline
        .run_until(copy, ops.stopping_on(stop.wait()))
        .await
        .map(drop)
        .map_err(Failure::from);
    ops.finished(&result).await;
    progress.finish(pipeline.stats().into()).await;
    common::close(pipeline.close(Duration::from_secs(10))).await;
    ops.linger(&stop).await;
    result
}
