//! Polling until something holds. The timeouts bound a failure only: nothing here measures
//! latency, so a loaded two-core machine makes a test slower, not wrong.

use std::time::{Duration, Instant};

/// Calls `f` every 100 ms until it returns `Some`, or `timeout` passes (then `None`).
pub fn wait_for<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `f`'s value once it is `Some`; panics naming `what` when `timeout` passes first.
pub fn expect_within<T>(what: &str, timeout: Duration, f: impl FnMut() -> Option<T>) -> T {
    wait_for(timeout, f).unwrap_or_else(|| panic!("timed out after {timeout:?} waiting for {what}"))
}

/// Async: polls `f` every 10 ms until it holds or `timeout` passes; its last answer.
pub async fn until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < timeout {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_for_returns_the_first_value() {
        let mut n = 0;
        let v = wait_for(Duration::from_secs(5), || {
            n += 1;
            (n == 3).then_some(n)
        });
        assert_eq!(v, Some(3));
    }

    #[test]
    fn wait_for_gives_up() {
        let t0 = Instant::now();
        assert_eq!(wait_for(Duration::from_millis(250), || None::<()>), None);
        assert!(t0.elapsed() >= Duration::from_millis(250));
    }

    #[test]
    #[should_panic(expected = "waiting for the answer")]
    fn expect_within_names_what_it_waited_for() {
        expect_within("the answer", Duration::from_millis(10), || None::<()>);
    }

    #[tokio::test]
    async fn until_sees_a_condition_turn_true() {
        let t0 = Instant::now();
        assert!(
            until(Duration::from_secs(5), || t0.elapsed()
                > Duration::from_millis(50))
            .await
        );
        assert!(!until(Duration::from_millis(30), || false).await);
    }
}
