//! Splitting a buffer across scoped threads.

/// Below this many elements per thread a spawn (~20 µs) costs more than it saves.
pub(crate) const MIN_ELEMENTS_PER_THREAD: usize = 1 << 15;

/// Runs `work` over `data` cut into at most `threads` pieces on whole
/// `unit`-element boundaries (rows), in parallel when the pieces are big
/// enough; `work` gets each piece and the index of its first unit.
pub(crate) fn for_each_piece<F>(data: &mut [f32], unit: usize, threads: usize, work: F)
where
    F: Fn(&mut [f32], usize) + Sync,
{
    let units = data.len().checked_div(unit).unwrap_or(0);
    let by_size = data.len() / MIN_ELEMENTS_PER_THREAD;
    let pieces = threads.min(by_size).min(units).max(1);
    if pieces == 1 {
        work(data, 0);
        return;
    }
    let per_piece = units.div_ceil(pieces);
    std::thread::scope(|scope| {
        let mut chunks = data.chunks_mut(per_piece * unit).enumerate();
        // The caller's thread takes the first piece instead of idling.
        let first = chunks.next();
        for (i, chunk) in chunks {
            let work = &work;
            scope.spawn(move || work(chunk, i * per_piece));
        }
        if let Some((_, chunk)) = first {
            work(chunk, 0);
        }
    });
}
