//! Threads that fetch ahead of sequential readers: a remote object hands
//! them the blocks past what its reader asked for (claimed, so that a
//! reader needing one waits for that fetch instead of asking the store
//! again), and several fetches are in flight at once.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};

/// Fetches in flight at most (threads).
pub(crate) const PREFETCH_THREADS: usize = 32;

type Job = Box<dyn FnOnce() + Send>;

/// The pool; threads start with the first job and end with the pool.
#[derive(Debug)]
pub(crate) struct Prefetcher {
    sender: Mutex<Option<Sender<Job>>>,
}

impl Prefetcher {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Prefetcher {
            sender: Mutex::new(None),
        })
    }

    /// Runs `job` on a prefetch thread; `false` if none could be started
    /// (the caller gives its claims up).
    pub(crate) fn run(&self, job: impl FnOnce() + Send + 'static) -> bool {
        let mut sender = self.sender.lock().unwrap_or_else(PoisonError::into_inner);
        if sender.is_none() {
            let (tx, rx) = channel::<Job>();
            let rx = Arc::new(Mutex::new(rx));
            let mut started = 0;
            for i in 0..PREFETCH_THREADS {
                let rx = rx.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("store-prefetch-{i}"))
                    .spawn(move || work(&rx));
                if spawned.is_ok() {
                    started += 1;
                }
            }
            if started == 0 {
                return false;
            }
            *sender = Some(tx);
        }
        sender
            .as_ref()
            .is_some_and(|tx| tx.send(Box::new(job)).is_ok())
    }
}

fn work(rx: &Mutex<Receiver<Job>>) {
    loop {
        let job = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
        match job {
            Ok(job) => job(),
            Err(_) => return,
        }
    }
}
