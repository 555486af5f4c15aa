# frozen_string_literal: true

require_relative 'client'

module PuppetX
  module Vmhost
    # Snapshots and backups through vmhostd (vm.snapshots, vm.snapshot, vm.revert,
    # vm.snapshot_delete, vm.export, vm.import, vm.backups_prune): what the vmhost_snapshot
    # provider, the functions vmhost::snapshots, vmhost::revert, vmhost::export,
    # vmhost::import and vmhost::backups_prune and the
    # module's tasks call. Only the request is shaped here: every option but `socket` is sent
    # as a param as given (one this module does not know, such as one a newer vmhostd added,
    # included), and vmhostd checks them all.
    #
    # Order of use: `params` shapes a request, `wait` says how long to wait for its answer,
    # `call` (or one of the named methods built on it) sends it; `noop_answer` is what a
    # function returns instead under --noop.
    module Backup
      # vm.snapshot's, vm.revert's, vm.snapshot_delete's and vm.export's own default for timeout_s.
      DEFAULT_COPY_TIMEOUT_S = 3600
      # How long vm.import and vm.backups_prune are waited for (they have no timeout of their
      # own: whole disk files are copied out of backups and hashed, for a prune when it merges
      # an increment into a full backup).
      IMPORT_TIMEOUT = 6 * 3600
      # Options that shape the client, never sent.
      CLIENT_OPTIONS = %w[socket].freeze

      # BASE (the method's required params) with OPTS (string or symbol keys) but the client's
      # own options; OPTS never override BASE.
      def self.params(base, opts = {})
        # Not Hash#except: Puppet 7's own packages bundle Ruby 2.7.
        extra = (opts || {}).to_h.each_with_object({}) do |(key, value), sent|
          sent[key.to_s] = value unless CLIENT_OPTIONS.include?(key.to_s)
        end
        extra.merge(base)
      end

      # Seconds to wait for METHOD's answer: vm.import and vm.backups_prune IMPORT_TIMEOUT; a copy (vm.snapshot,
      # vm.revert, vm.export) or a delete of a snapshot's tags (vm.snapshot_delete) the client's
      # mutating timeout plus its timeout_s (the daemon's
      # default when not given, or when it is not a whole number: the daemon then refuses it
      # at once); anything else the mutating timeout.
      def self.wait(method, params)
        return IMPORT_TIMEOUT if %w[vm.import vm.backups_prune].include?(method)
        return Client::MUTATING_TIMEOUT unless %w[vm.snapshot vm.revert vm.snapshot_delete vm.export].include?(method)

        bound = params['timeout_s']
        bound = DEFAULT_COPY_TIMEOUT_S unless bound.is_a?(Integer) && !bound.negative?
        Client::MUTATING_TIMEOUT + bound
      end

      # Sends METHOD with PARAMS on SOCKET (nil: the default) and returns the daemon's answer;
      # raises Vmhost::Error (a refusal as DaemonError with its code, field and details).
      def self.call(method, params, socket: nil, client: nil)
        client ||= Client.new(socket, timeout: Client::MUTATING_TIMEOUT)
        client.call(method, params, timeout: wait(method, params))
      end

      # What a function returns instead of sending under --noop.
      def self.noop_answer(method, params)
        { 'noop' => true, 'method' => method, 'params' => params }
      end

      # The body of the functions vmhost::export, ::import, ::revert and ::backups_prune:
      # METHOD with BASE (the function's arguments) and OPTS shaped by `params`, nothing sent
      # under --noop (`noop_answer`), else sent and waited for; a refusal raised as a
      # Puppet::Error naming FUNCTION (it fails the compilation). Only called from Puppet.
      def self.function_call(function, method, base, opts)
        opts ||= {}
        sent = params(base, opts)
        return noop_answer(method, sent) if Puppet[:noop]

        call(method, sent, socket: opts['socket'])
      rescue Vmhost::Error => e
        raise Puppet::Error, "#{function}: #{e.message}"
      end

      # VM's snapshots, oldest first, as vm.snapshot answered each.
      def self.snapshots(vm, opts = {}, client: nil)
        client ||= Client.new(opts_socket(opts))
        client.call('vm.snapshots', { 'name' => vm })
      end

      def self.snapshot(vm, snapshot, opts = {}, client: nil)
        call('vm.snapshot', params({ 'name' => vm, 'snapshot' => snapshot }, opts),
             socket: opts_socket(opts), client: client)
      end

      def self.snapshot_delete(vm, snapshot, opts = {}, client: nil)
        call('vm.snapshot_delete', params({ 'name' => vm, 'snapshot' => snapshot }, opts),
             socket: opts_socket(opts), client: client)
      end

      # The socket option of OPTS (string or symbol key), or nil.
      def self.opts_socket(opts)
        opts = (opts || {}).to_h
        opts['socket'] || opts[:socket]
      end
    end
  end
end
