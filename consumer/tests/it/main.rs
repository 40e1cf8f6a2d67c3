//! The consumer's integration tests, one binary, against the local stack
//! (scripts/dev-stack) through the test kit (testkit/): the library against
//! PostgreSQL and ministack, the job state machine's property test, and the
//! Python worker on what the relay publishes.

mod consumer;
mod consumer_state_machine;
mod python_worker;
