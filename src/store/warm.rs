//! Readers' connections, the one released last handed out first.
//!
//! sqlx's pool keeps its idle connections in a FIFO queue and pings each one it takes back (a
//! round trip after every release, on a task of its own). Under light load that rotates calls
//! through every connection the pool has opened: each is a database backend of its own whose
//! caches (PostgreSQL's plans, catalog and relation caches, the CPU's caches of its memory)
//! went cold since its last turn. On PostgreSQL, `pay` at one caller ran about 12% faster with a
//! pool of one connection than with the default 16 (docs/benchmarks-history.md, "Readers'
//! connections, the one released last handed out first").
//!
//! So a [`Reader`](super::Reader) whose statements all succeeded (the read before a batch, a
//! replay's read, and a batch of one's read and write that commits itself:
//! [`Pooled::released_clean`]) leaves its connection here, still checked out of sqlx's pool,
//! and the next taker, reader or transaction, gets the one released last, with no ping. Everything else goes back through sqlx's pool as before:
//! - a transaction's connection (a write transaction, a snapshot). Keeping those too was
//!   measured: a connection reused by transaction after transaction with no ping between them
//!   made `transfer` at one caller about 10% slower on PostgreSQL, and `pay` on MariaDB 25 to
//!   30% slower (there only with readers' connections kept too; the server counted the same
//!   statements, the pings aside). The cause was not found;
//! - a connection dropped after an error or a cancellation: sqlx's release ping closes a broken
//!   one, so a connection the database ended fails one use at most;
//! - one released while a taker waits on sqlx's pool, so no taker waits while a connection
//!   sits here;
//! - one whose hold is over: none is handed out more than its hold after it last left sqlx's
//!   pool (one past it goes back when next taken or released), so sqlx's age and idle bounds
//!   still apply. The hold is [`WARM_HOLD`] (5 s), on PostgreSQL at most a tenth of
//!   `--plan-lifetime-seconds`, and sqlx's own age bound is lowered by as much, so no
//!   connection is used past the plan lifetime;
//! - every one on MySQL/MariaDB, where keeping readers' connections alone measured no faster;
//! - every one once the store closes.
//!
//! Bounds: its connections are the pool's, counted in `--pool-size`; nothing waits on it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Any, AnyConnection, AnyPool};

/// The longest a kept connection is handed out after it last left sqlx's pool: 5 s (on
/// PostgreSQL at most a tenth of `--plan-lifetime-seconds`).
pub(super) const WARM_HOLD: Duration = Duration::from_secs(5);

/// Connections taken from sqlx's pool and released cleanly, most recent last.
pub(super) struct WarmSet {
    state: Mutex<State>,
    /// The longest a kept connection is handed out after it last left sqlx's pool.
    hold: Duration,
    /// False: none is kept, every connection goes back through sqlx's pool.
    keeps: bool,
}

#[derive(Default)]
struct State {
    idle: Vec<Idle>,
    /// Takers waiting on sqlx's pool: while there are any, a release goes to them.
    waiting: usize,
    closed: bool,
}

struct Idle {
    connection: PoolConnection<Any>,
    /// When it was taken from sqlx's pool.
    taken: Instant,
}

impl WarmSet {
    /// A warm set that hands out no kept connection more than `hold` after it last left
    /// sqlx's pool; with `keeps` false, one that keeps none.
    pub(super) fn new(hold: Duration, keeps: bool) -> Self {
        Self { state: Mutex::default(), hold, keeps }
    }

    /// The connection released last, else one from `pool` (waiting up to the pool's acquire
    /// timeout).
    ///
    /// # Errors
    /// sqlx's pool's error: [`sqlx::Error::PoolTimedOut`], [`sqlx::Error::PoolClosed`], or the
    /// error of opening a new connection.
    pub(super) async fn take(self: &Arc<Self>, pool: &AnyPool) -> Result<Pooled, sqlx::Error> {
        let mut stale = Vec::new();
        let mut waiting = None;
        let warm = {
            let mut state = self.state();
            let mut warm = None;
            while let Some(idle) = state.idle.pop() {
                if idle.taken.elapsed() > self.hold {
                    stale.push(idle.connection);
                } else {
                    warm = Some(idle);
                    break;
                }
            }
            if warm.is_none() {
                state.waiting += 1;
                waiting = Some(Waiting(self.as_ref()));
            }
            warm
        };
        // Back through sqlx's pool, outside the lock: its release ping and age bound run.
        drop(stale);
        if let Some(idle) = warm {
            return Ok(Pooled {
                connection: Some(idle.connection),
                taken: idle.taken,
                home: self.clone(),
                clean: false,
            });
        }
        let taken = pool.acquire().await;
        drop(waiting);
        Ok(Pooled { connection: Some(taken?), taken: Instant::now(), home: self.clone(), clean: false })
    }

    /// Hands every kept connection back to sqlx's pool and keeps none from now on (before
    /// the pool closes, which waits for its connections to come back).
    pub(super) fn close(&self) {
        let idle = {
            let mut state = self.state();
            state.closed = true;
            std::mem::take(&mut state.idle)
        };
        drop(idle);
    }

    /// The set's state. Nothing panics while holding it; were it poisoned, its counts are
    /// still whole (each is changed by one statement), so it is used as is.
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How many connections are kept here.
    pub(super) fn len(&self) -> usize {
        self.state().idle.len()
    }

    fn release(&self, connection: PoolConnection<Any>, taken: Instant) {
        let mut state = self.state();
        if !self.keeps || state.closed || state.waiting > 0 || taken.elapsed() > self.hold {
            drop(state);
            drop(connection);
            return;
        }
        state.idle.push(Idle { connection, taken });
    }
}

/// A taker waiting on sqlx's pool, counted until it has its connection or gives up (its
/// future dropped included).
struct Waiting<'a>(&'a WarmSet);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.state().waiting -= 1;
    }
}

/// A connection taken through the [`WarmSet`]. Dropped, it goes back to sqlx's pool (its
/// release ping runs), unless [`Pooled::released_clean`] said its work ended cleanly: then it
/// is kept warm (within the set's rules).
pub(super) struct Pooled {
    /// Taken by `drop`.
    connection: Option<PoolConnection<Any>>,
    taken: Instant,
    home: Arc<WarmSet>,
    clean: bool,
}

impl Pooled {
    /// Marks the connection's work as ended cleanly: no transaction open, no statement in
    /// flight, and its last statement answered. Call it only right after that statement.
    pub(super) fn released_clean(&mut self) {
        self.clean = true;
    }

    /// The connection, to go back through sqlx's pool when dropped.
    pub(super) fn into_pool_connection(mut self) -> PoolConnection<Any> {
        self.connection.take().expect("held until dropped")
    }
}

impl std::ops::Deref for Pooled {
    type Target = AnyConnection;
    fn deref(&self) -> &AnyConnection {
        self.connection.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for Pooled {
    fn deref_mut(&mut self) -> &mut AnyConnection {
        self.connection.as_mut().expect("held until dropped")
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let Some(connection) = self.connection.take() else { return };
        if self.clean {
            self.home.release(connection, self.taken);
        }
    }
}

#[cfg(test)]
mod tests {
    //! The warm set over a real sqlx pool (SQLite in a temporary file; PostgreSQL too when
    //! `PAYLEDGER_TEST_POSTGRES_URL` names a server). A connection is told apart by a
    //! temporary table, which lives as long as its session.

    use super::*;
    use sqlx::any::AnyPoolOptions;
    use sqlx::Executor;

    const TAKE: Duration = Duration::from_secs(20);

    async fn sqlite_pool(directory: &tempfile::TempDir, size: u32) -> AnyPool {
        sqlx::any::install_default_drivers();
        let url = format!("sqlite:{}?mode=rwc", directory.path().join("warm.db").display());
        AnyPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(2))
            .test_before_acquire(false)
            .connect(&url)
            .await
            .unwrap()
    }

    async fn take(warm: &Arc<WarmSet>, pool: &AnyPool) -> Pooled {
        tokio::time::timeout(TAKE, warm.take(pool)).await.expect("a take within 20 s").unwrap()
    }

    /// Gives the connection a name only its own session sees.
    async fn mark(connection: &mut Pooled, name: &str) {
        connection.execute(format!("CREATE TEMPORARY TABLE {name} (x INTEGER)").as_str()).await.unwrap();
    }

    async fn is_marked(connection: &mut Pooled, name: &str) -> bool {
        connection.execute(format!("SELECT x FROM {name}").as_str()).await.is_ok()
    }

    #[tokio::test]
    async fn the_connection_released_clean_last_is_handed_out_first() {
        let directory = tempfile::tempdir().unwrap();
        let pool = sqlite_pool(&directory, 3).await;
        let warm = Arc::new(WarmSet::new(Duration::from_secs(60), true));
        let mut first = take(&warm, &pool).await;
        let mut second = take(&warm, &pool).await;
        let mut third = take(&warm, &pool).await;
        mark(&mut first, "first").await;
        mark(&mut second, "second").await;
        mark(&mut third, "third").await;
        first.released_clean();
        second.released_clean();
        // Not released clean: back through sqlx's pool, not kept.
        drop(third);
        drop(first);
        drop(second);
        assert_eq!(warm.len(), 2);
        let mut again = take(&warm, &pool).await;
        assert!(is_marked(&mut again, "second").await, "the one released last comes first");
        let mut next = take(&warm, &pool).await;
        assert!(is_marked(&mut next, "first").await, "then the one before it");
        assert_eq!(warm.len(), 0);
        let mut from_pool = take(&warm, &pool).await;
        assert!(is_marked(&mut from_pool, "third").await, "then sqlx's pool: the one not kept");
    }

    #[tokio::test]
    async fn a_release_while_a_taker_waits_on_the_pool_goes_to_that_taker() {
        let directory = tempfile::tempdir().unwrap();
        let pool = sqlite_pool(&directory, 1).await;
        let warm = Arc::new(WarmSet::new(Duration::from_secs(60), true));
        let mut only = take(&warm, &pool).await;
        let waiter = {
            let (warm, pool) = (warm.clone(), pool.clone());
            tokio::spawn(async move { warm.take(&pool).await.map(|_| ()) })
        };
        while warm.state.lock().unwrap().waiting == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        only.released_clean();
        drop(only);
        assert_eq!(warm.len(), 0, "not kept while a taker waits");
        // Kept, the waiter would time out after the pool's 2 s.
        let taken = tokio::time::timeout(TAKE, waiter).await.expect("the waiter ends").unwrap();
        assert!(taken.is_ok(), "the waiter has the connection: {taken:?}");
        assert_eq!(warm.state.lock().unwrap().waiting, 0);
    }

    #[tokio::test]
    async fn a_cancelled_taker_stops_counting_as_waiting() {
        let directory = tempfile::tempdir().unwrap();
        let pool = sqlite_pool(&directory, 1).await;
        let warm = Arc::new(WarmSet::new(Duration::from_secs(60), true));
        let mut only = take(&warm, &pool).await;
        let cancelled = tokio::time::timeout(Duration::from_millis(50), warm.take(&pool)).await;
        assert!(cancelled.is_err(), "no connection was free");
        assert_eq!(warm.state.lock().unwrap().waiting, 0);
        only.released_clean();
        drop(only);
        assert_eq!(warm.len(), 1, "kept: no one waits");
    }

    #[tokio::test]
    async fn a_connection_held_past_its_hold_goes_back_through_the_pool() {
        let directory = tempfile::tempdir().unwrap();
        let pool = sqlite_pool(&directory, 2).await;
        let warm = Arc::new(WarmSet::new(Duration::from_secs(1), true));
        let mut old = take(&warm, &pool).await;
        let mut other = take(&warm, &pool).await;
        mark(&mut old, "old").await;
        mark(&mut other, "other").await;
        drop(other);
        old.released_clean();
        drop(old);
        assert_eq!(warm.len(), 1);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        // Past its hold, the kept one goes back to sqlx's pool, behind the one already there.
        let mut next = take(&warm, &pool).await;
        assert_eq!(warm.len(), 0);
        assert!(is_marked(&mut next, "other").await, "sqlx's pool's idle connection, not the stale one");
        // Released clean past its hold: not kept either.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        next.released_clean();
        drop(next);
        assert_eq!(warm.len(), 0);
    }

    /// The hold counts from when the connection left sqlx's pool, not from its last use: one
    /// reused warm without a pause still passes through sqlx's pool once its hold is over.
    #[tokio::test]
    async fn a_connection_reused_without_a_pause_still_goes_back_after_its_hold() {
        let directory = tempfile::tempdir().unwrap();
        let pool = sqlite_pool(&directory, 2).await;
        let warm = Arc::new(WarmSet::new(Duration::from_secs(1), true));
        let mut reused = take(&warm, &pool).await;
        let other = take(&warm, &pool).await;
        mark(&mut reused, "reused").await;
        // Idle in sqlx's pool, ahead of the reused one when that one goes back.
        drop(other);
        reused.released_clean();
        drop(reused);
        let mut takes = Vec::new();
        for _ in 0..25 {
            let mut connection = take(&warm, &pool).await;
            takes.push(is_marked(&mut connection, "reused").await);
            connection.released_clean();
            drop(connection);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(takes[0], "the kept one is handed out first");
        assert!(takes.contains(&false), "past its hold it went back to sqlx's pool: {takes:?}");
    }

    #[tokio::test]
    async fn a_set_that_keeps_none_and_a_closed_one_hand_everything_back() {
        let directory = tempfile::tempdir().unwrap();
        let pool = sqlite_pool(&directory, 2).await;
        let none = Arc::new(WarmSet::new(Duration::from_secs(60), false));
        let mut connection = take(&none, &pool).await;
        connection.released_clean();
        drop(connection);
        assert_eq!(none.len(), 0);

        let warm = Arc::new(WarmSet::new(Duration::from_secs(60), true));
        let mut kept = take(&warm, &pool).await;
        let mut later = take(&warm, &pool).await;
        kept.released_clean();
        drop(kept);
        assert_eq!(warm.len(), 1);
        warm.close();
        assert_eq!(warm.len(), 0);
        later.released_clean();
        drop(later);
        assert_eq!(warm.len(), 0, "a closed set keeps nothing");
        // sqlx's pool closes: every connection came back to it.
        tokio::time::timeout(TAKE, pool.close()).await.expect("the pool closes");
    }

    /// PostgreSQL: a kept connection the server ended fails one use; not released clean, it
    /// goes back through sqlx's pool (whose release ping closes it), and the next take works.
    #[tokio::test]
    async fn a_kept_connection_the_server_ended_fails_once_and_is_not_kept() {
        let Ok(url) = std::env::var("PAYLEDGER_TEST_POSTGRES_URL") else {
            assert!(std::env::var("CI").as_deref() != Ok("true"), "PAYLEDGER_TEST_POSTGRES_URL is required in CI");
            return;
        };
        sqlx::any::install_default_drivers();
        // One connection: the take after the failure has the pool's only slot, so it works only
        // if sqlx's release ping closed the ended one.
        let pool = AnyPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .test_before_acquire(false)
            .connect(&url)
            .await
            .unwrap();
        let admin = AnyPoolOptions::new().max_connections(1).connect(&url).await.unwrap();
        let warm = Arc::new(WarmSet::new(Duration::from_secs(60), true));
        let mut connection = take(&warm, &pool).await;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *connection).await.unwrap();
        connection.released_clean();
        drop(connection);
        let ended: bool =
            sqlx::query_scalar("SELECT pg_terminate_backend($1)").bind(pid).fetch_one(&admin).await.unwrap();
        assert!(ended);
        let mut dead = take(&warm, &pool).await;
        let failed = sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()").fetch_one(&mut *dead).await;
        assert!(failed.is_err(), "the ended session answers nothing");
        drop(dead);
        assert_eq!(warm.len(), 0);
        let mut fresh = take(&warm, &pool).await;
        let new_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *fresh).await.unwrap();
        assert_ne!(new_pid, pid);
        drop(fresh);
        pool.close().await;
        admin.close().await;
    }
}
