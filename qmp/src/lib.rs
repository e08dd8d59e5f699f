//! placeholder: replaced by the qmp issue's work
