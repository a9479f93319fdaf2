//! `replayguard pipe`: input topic to output topic through the guarded
//! pipeline (G1).

use std::convert::Infallible;
use std::time::Duration;

use rdkafka::message::OwnedMessage;
use replayguard::kafka::{GuardedPipeline, OutputRecord};

use crate::cli::PipeArgs;
use crate::common::{self, Failure, Stop};
use crate::progress::Progress;

pub async fn run(args: PipeArgs) -> Result<(), Failure> {
    let g = &args.guard;
    common::check_properties(g)?;
    common::check_state_for_run(&g.state)?;
    let mut builder = GuardedPipeline::builder(common::consumer_config(g), &g.state)
        .output(&args.output)
        .producer_config(common::producer_config(g))
        .mode(args.mode)
        .delivery_timeout(args.delivery_timeout)
        .identity(g.identity.clone())
        .checkpoint_interval(g.checkpoint_interval)
        .retention_epochs(g.retention_epochs)
        .retention_time(g.retention_time)
        .stop_at_end(g.stop_at_end)
        .connect_attempts(g.connect_attempts);
    if let Some(lease) = g.lease {
        builder = builder.lease(lease);
    }
    builder = builder.rebind(g.rebind);
    for input in &args.input {
        builder = builder.input(input);
    }
    let stop = Stop::install()?;
    let Some(mut pipeline) = common::start(move || builder.build(), &stop).await? else {
        return Ok(());
    };
    let handle = pipeline.stats_handle();
    let progress = Progress::start(true, true, move || handle.stats());
    let copy =
        |m: OwnedMessage| async move { Ok::<_, Infallible>(vec![OutputRecord::copy_of(&m)]) };
    let result = pipeline.run_until(copy, stop.wait()).await;
    progress.finish(pipeline.stats()).await;
    common::close(pipeline, Duration::from_secs(10));
    result.map(drop).map_err(Failure::from)
}
