//! `serve` drains and returns Ok on SIGTERM (own test binary: the signal goes to this process).

mod common;

use std::time::Duration;

use common::*;
use mlx_embed_core::DeviceKind;
use mlx_embed_server::{serve, ServerArgs};

#[cfg(unix)]
#[tokio::test]
async fn sigterm_shuts_down_cleanly() {
    let args = ServerArgs {
        port: 0,
        max_batch_size: Some(2),
        ..test_args()
    };
    let batcher = tokio::task::spawn_blocking({
        let config = args.batcher_config(DeviceKind::Cpu);
        move || start_batcher(config)
    })
    .await
    .unwrap();
    let server = tokio::spawn(serve(
        ServerArgs {
            no_warmup: false,
            ..args
        },
        batcher.clone(),
        Duration::ZERO,
    ));
    // Warm-up done and serving: the handlers are installed before the warm-up.
    for _ in 0..200 {
        if batcher.metrics().requests_ok >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let status = std::process::Command::new("kill")
        .args(["-TERM", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let result = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("serve returns")
        .unwrap();
    assert!(result.is_ok(), "{result:?}");
    assert!(!batcher.is_healthy(), "batcher closed");
}
