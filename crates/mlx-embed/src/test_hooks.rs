//! Test-only fault injection around the real model, compiled only with the
//! `test-hooks` feature (the `mlx-embed-server-test` binary): the end-to-end
//! tests prove that a model error fails only its own request and that a dead
//! model thread is noticed, against the real server and model.
//!
//! * `MLX_EMBED_TEST_FAULT=<marker>`: a batch holding an input whose text
//!   contains the marker fails with a model error naming that input's index
//!   in the batch (`RuntimeError: injected test fault on input N`).
//! * `MLX_EMBED_TEST_KILL=<marker>`: such a batch panics the model thread.
//!
//! The marker is seen where the text still exists, at tokenization; the ids
//! it became are remembered and recognised when their batch runs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use mlx_embed_core::{
    BatchOutput, EmbedInput, EmbedOptions, Embedder, EmbedderError, Encoded, LiveStats, ModelInfo,
    Output, Submitted, Ticket, Tokenize,
};
use mlx_embed_python::PythonEmbedder;

/// Runs the server with the hooks the environment asks for.
pub fn run(argv: Vec<String>) -> i32 {
    let fault = marker("MLX_EMBED_TEST_FAULT");
    let kill = marker("MLX_EMBED_TEST_KILL");
    // Cloned per model: a server with several models wraps each.
    crate::launch::run_with(argv, move |model| {
        Faulty::new(model, fault.clone(), kill.clone())
    })
}

fn marker(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|m| !m.is_empty())
}

/// What a marked input did: fail its batch, or kill the model thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hook {
    Fault,
    Kill,
}

/// Ids of the inputs that carried a marker, and what they do (a kill wins).
#[derive(Default)]
struct Marked(Mutex<HashMap<Vec<u32>, Hook>>);

impl Marked {
    fn add(&self, ids: &[u32], hook: Hook) {
        let mut marked = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = marked.entry(ids.to_vec()).or_insert(hook);
        if hook == Hook::Kill {
            *entry = Hook::Kill;
        }
    }

    fn hook(&self, ids: &[u32]) -> Option<Hook> {
        let marked = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        marked.get(ids).copied()
    }
}

/// The model's tokenizer, remembering the ids of marked texts.
struct MarkingTokenizer {
    inner: Arc<dyn Tokenize>,
    fault: Option<String>,
    kill: Option<String>,
    marked: Arc<Marked>,
}

impl Tokenize for MarkingTokenizer {
    fn encode(&self, input: &EmbedInput, options: &EmbedOptions) -> Result<Encoded, EmbedderError> {
        let encoded = self.inner.encode(input, options)?;
        if let EmbedInput::Text(text) = input {
            let carries = |m: &Option<String>| m.as_deref().is_some_and(|m| text.contains(m));
            if carries(&self.kill) {
                self.marked.add(&encoded.ids, Hook::Kill);
            }
            if carries(&self.fault) {
                self.marked.add(&encoded.ids, Hook::Fault);
            }
        }
        Ok(encoded)
    }
}

/// The real model behind the hooks.
pub struct Faulty {
    model: PythonEmbedder,
    tokenizer: Option<Arc<dyn Tokenize>>,
    marked: Arc<Marked>,
}

impl Faulty {
    fn new(model: PythonEmbedder, fault: Option<String>, kill: Option<String>) -> Self {
        let marked = Arc::new(Marked::default());
        let tokenizer = model.tokenizer().map(|inner| {
            Arc::new(MarkingTokenizer {
                inner,
                fault,
                kill,
                marked: marked.clone(),
            }) as Arc<dyn Tokenize>
        });
        Self {
            model,
            tokenizer,
            marked,
        }
    }
}

impl Embedder for Faulty {
    fn info(&self) -> ModelInfo {
        self.model.info()
    }

    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
        self.tokenizer.clone()
    }

    fn live_stats(&self) -> Option<Arc<dyn LiveStats>> {
        self.model.live_stats()
    }

    fn embed_batch(
        &mut self,
        inputs: &[Encoded],
        output: Output,
    ) -> Result<BatchOutput, EmbedderError> {
        self.injected(inputs)?;
        self.model.embed_batch(inputs, output)
    }

    fn pipelines(&self) -> bool {
        self.model.pipelines()
    }

    /// A hooked batch is never queued: its ticket carries the injected fault,
    /// which it answers when collected, as a failure on the device would.
    fn submit(&mut self, next: &[Encoded], output: Output, running: Option<Ticket>) -> Submitted {
        let (failed, inner_running) = match running.map(Hooked::from_ticket) {
            Some(Hooked::Failed(error)) => (Some(Err(error)), None),
            Some(Hooked::Queued(ticket)) => (None, Some(ticket)),
            None => (None, None),
        };
        match self.injected(next) {
            Err(error) => Submitted {
                next: Ok(Ticket::new(Hooked::Failed(error))),
                running: failed.or_else(|| inner_running.map(|t| self.model.collect(t))),
            },
            Ok(()) => {
                let step = self.model.submit(next, output, inner_running);
                Submitted {
                    next: step.next.map(|t| Ticket::new(Hooked::Queued(t))),
                    running: failed.or(step.running),
                }
            }
        }
    }

    fn collect(&mut self, ticket: Ticket) -> Result<BatchOutput, EmbedderError> {
        match Hooked::from_ticket(ticket) {
            Hooked::Failed(error) => Err(error),
            Hooked::Queued(ticket) => self.model.collect(ticket),
        }
    }
}

/// A batch [`Faulty`] submitted: failed by a hook, or queued on the model.
enum Hooked {
    Failed(EmbedderError),
    Queued(Ticket),
}

impl Hooked {
    fn from_ticket(ticket: Ticket) -> Self {
        ticket
            .into_inner()
            .unwrap_or_else(|_| panic!("a ticket Faulty did not issue"))
    }
}

impl Faulty {
    /// Panics for a batch holding a kill marker; fails one holding a fault marker.
    fn injected(&self, inputs: &[Encoded]) -> Result<(), EmbedderError> {
        let hooks: Vec<Option<Hook>> = inputs.iter().map(|e| self.marked.hook(&e.ids)).collect();
        if hooks.contains(&Some(Hook::Kill)) {
            panic!("test hook MLX_EMBED_TEST_KILL: killing the model thread");
        }
        if let Some(i) = hooks.iter().position(|h| *h == Some(Hook::Fault)) {
            return Err(EmbedderError::model_failure(format!(
                "RuntimeError: injected test fault on input {i}"
            )));
        }
        Ok(())
    }
}
