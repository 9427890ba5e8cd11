//! ns per element of the kernels on engine-sized buffers, 1 and 2 threads.
//!
//! cargo bench -p mlx-embed-kernels --bench kernels

use std::time::Instant;

use mlx_embed_kernels::{
    attention, gelu, linear, masked_softmax, pack_weights, packed_len, simd_level, Activation,
    AttentionShape, LinearShape, SoftmaxShape,
};

fn median_ns_per_element(elements: usize, mut run: impl FnMut()) -> f64 {
    run();
    let mut times: Vec<f64> = (0..15)
        .map(|_| {
            let t = Instant::now();
            run();
            t.elapsed().as_nanos() as f64 / elements as f64
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    println!("simd: {}", simd_level());
    // A 1024-token sub-batch of 8 sequences x 128 tokens, 12 heads.
    let shape = SoftmaxShape {
        sequences: 8,
        rows_per_sequence: 12 * 128,
        row_len: 128,
    };
    let n = 8 * 12 * 128 * 128;
    let source: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 50.0 - 10.0)
        .collect();
    let lens = [128, 120, 110, 100, 128, 64, 90, 128];
    for threads in [1, 2] {
        let mut buf = source.clone();
        let ns = median_ns_per_element(n, || {
            buf.copy_from_slice(&source);
            masked_softmax(&mut buf, shape, &lens, 0.125, threads).unwrap();
        });
        println!("masked_softmax [8,12,128,128] threads {threads}: {ns:.3} ns/element (incl. refill copy)");
    }
    let n = 1024 * 1536;
    let source: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 100.0 - 5.0)
        .collect();
    for threads in [1, 2] {
        let mut buf = source.clone();
        let ns = median_ns_per_element(n, || {
            buf.copy_from_slice(&source);
            gelu(&mut buf, threads);
        });
        println!("gelu [1024,1536] threads {threads}: {ns:.3} ns/element (incl. refill copy)");
    }
    // MiniLM's attention (12 heads of 32) at one short text, and at a
    // sub-batch of 8 sequences x 128 positions, some of them padding.
    for (batch, len, lens) in [(1, 22, vec![22]), (8, 128, lens.to_vec())] {
        let shape = AttentionShape {
            batch,
            len,
            heads: 12,
            head_dim: 32,
        };
        let qkv: Vec<f32> = (0..batch * len * 3 * 384)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let mut out = vec![0.0; batch * len * 384];
        for threads in [1, 2] {
            let madds = batch * len * len * 384 * 2;
            let ns = median_ns_per_element(madds, || {
                attention(&qkv, &lens, shape, 0.18, &mut out, threads).unwrap();
            });
            println!(
                "attention [{batch},{len},12x32] threads {threads}: {:.1} GFLOP/s (q.k and p.v multiply-adds)",
                2.0 / ns
            );
        }
    }
    // MiniLM's four linear layers at one short text (17 tokens) and at a
    // full 256-token sub-batch.
    for rows in [17, 256] {
        for (inputs, outputs) in [(384, 1152), (384, 384), (384, 1536), (1536, 384)] {
            let x: Vec<f32> = (0..rows * inputs).map(|i| (i % 97) as f32 / 97.0).collect();
            let w: Vec<f32> = (0..outputs * inputs)
                .map(|i| (i % 89) as f32 / 89.0)
                .collect();
            let mut packed = vec![0.0; packed_len(outputs, inputs)];
            pack_weights(&w, outputs, inputs, &mut packed).unwrap();
            let bias = vec![0.5; outputs];
            let mut out = vec![0.0; rows * outputs];
            let shape = LinearShape {
                rows,
                inputs,
                outputs,
            };
            for threads in [1, 2] {
                let ns = median_ns_per_element(rows * inputs * outputs, || {
                    linear(
                        &x,
                        &packed,
                        Some(&bias),
                        &mut out,
                        shape,
                        Activation::None,
                        threads,
                    )
                    .unwrap();
                });
                println!(
                    "linear [{rows},{inputs}] x [{inputs},{outputs}] threads {threads}: {:.1} GFLOP/s",
                    2.0 / ns
                );
            }
        }
    }
}
