//! Whether the engine is ready to serve: between start and the end of the engine's warm-up
//! (compiling CUDA kernels, capturing graphs), `/health` answers 503 with the stage and
//! completion requests get a 503 saying to retry, as llama-server does while it loads.

use std::sync::Mutex;
use std::time::Instant;

/// The engine's readiness, shared by the engine loop (which moves it) and the handlers.
#[derive(Debug)]
pub struct Readiness {
    state: Mutex<State>,
    started: Instant,
}

#[derive(Debug, Clone, PartialEq)]
enum State {
    /// Warming up; the stage now running.
    Warming(String),
    Ready,
    /// The warm-up failed; the server cannot serve.
    Failed(String),
}

/// Why the server is not ready: the `/health` status word and a reason.
#[derive(Debug, Clone, PartialEq)]
pub struct NotReady {
    /// `loading` or `error`.
    pub status: &'static str,
    /// What is running, or what failed.
    pub reason: String,
}

impl Readiness {
    /// Ready from the start (an engine with nothing to warm up, and the tests' fakes).
    pub fn ready() -> Readiness {
        Readiness {
            state: Mutex::new(State::Ready),
            started: Instant::now(),
        }
    }

    /// Warming up, starting now.
    pub fn warming() -> Readiness {
        Readiness {
            state: Mutex::new(State::Warming("starting the engine".into())),
            started: Instant::now(),
        }
    }

    fn set(&self, state: State) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = state;
    }

    /// The warm-up's current stage.
    pub fn stage(&self, stage: &str) {
        self.set(State::Warming(stage.to_string()));
    }

    /// The warm-up is done: the server is ready. Logs the time since start.
    pub fn set_ready(&self) {
        self.set(State::Ready);
        tracing::info!(
            target: "pagoda_progress",
            "ready: serving after a {:.2} s warm-up",
            self.started.elapsed().as_secs_f64()
        );
    }

    /// The warm-up failed with `error`: `/health` reports it and requests are refused.
    pub fn set_failed(&self, error: &str) {
        tracing::error!("the engine's warm-up failed: {error}; the server cannot serve");
        self.set(State::Failed(error.to_string()));
    }

    /// `Ok` when ready, else why not.
    pub fn check(&self) -> Result<(), NotReady> {
        match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            State::Ready => Ok(()),
            State::Warming(stage) => Err(NotReady {
                status: "loading",
                reason: format!(
                    "warming up: {stage} ({:.0} s so far)",
                    self.started.elapsed().as_secs_f64()
                ),
            }),
            State::Failed(error) => Err(NotReady {
                status: "error",
                reason: format!("the warm-up failed: {error}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warming_then_ready_or_failed() {
        let readiness = Readiness::warming();
        let not_ready = readiness.check().unwrap_err();
        assert_eq!(not_ready.status, "loading");
        assert!(
            not_ready.reason.contains("starting the engine"),
            "{not_ready:?}"
        );
        readiness.stage("compiling CUDA kernels");
        let reason = readiness.check().unwrap_err().reason;
        assert!(
            reason.starts_with("warming up: compiling CUDA kernels ("),
            "{reason}"
        );
        readiness.set_ready();
        assert_eq!(readiness.check(), Ok(()));
        readiness.set_failed("no kernel image");
        let failed = readiness.check().unwrap_err();
        assert_eq!(failed.status, "error");
        assert!(failed.reason.contains("no kernel image"));
        assert_eq!(Readiness::ready().check(), Ok(()));
    }
}
