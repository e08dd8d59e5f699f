//! placeholder: replaced by the isolation issue's work
