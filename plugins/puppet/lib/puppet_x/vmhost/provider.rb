# frozen_string_literal: true

require_relative 'client'

module PuppetX
  module Vmhost
    # What the vmhostd providers (vmhost_vm, vmhost_image) share: the client, `instances` and
    # `prefetch` from the daemon's list call, the socket a resource talks to, and turning a
    # client error into a Puppet::Error.
    #
    # A provider includes it and defines, as class methods, `list_method` (the list call,
    # e.g. 'vm.list') and `hash_from_view(view, socket)` (its property hash from one view of
    # that list), and, as an instance method, `refusal_detail(err)` (text appended to the
    # message of a daemon refusal, or nil).
    module Provider
      def self.included(base)
        base.extend(ClassMethods)
      end

      # Class methods of an including provider.
      module ClassMethods
        def client(socket, timeout = PuppetX::Vmhost::Client::DEFAULT_TIMEOUT)
          PuppetX::Vmhost::Client.new(socket, timeout: timeout)
        end

        # `puppet resource TYPE`: everything in the list call's answer on the default socket.
        def instances
          socket = PuppetX::Vmhost.socket_path
          Array(client(socket).call(list_method)).map { |view| new(hash_from_view(view, socket)) }
        end

        # One list call per socket, views indexed by name. A socket that cannot be read leaves
        # its resources unprefetched; each of them then fails on its own with the connection
        # error.
        def prefetch(resources)
          resources.values.group_by { |r| PuppetX::Vmhost.socket_path(r[:socket]) }.each do |socket, group|
            begin
              views = client(socket).call(list_method)
            rescue PuppetX::Vmhost::Error => e
              Puppet.debug("#{resource_type.name}: prefetch from #{socket} failed: #{e.message}")
              next
            end
            by_name = {}
            Array(views).each { |v| by_name[v['name']] = v if v.is_a?(Hash) }
            group.each do |res|
              view = by_name[res[:name]]
              hash = view ? hash_from_view(view, socket) : { name: res[:name], ensure: :absent, socket: socket }
              res.provider = new(hash)
            end
          end
        end
      end

      # The resource's socket (an instance from `instances` has no resource: the one it was
      # read from).
      def socket
        explicit = resource ? resource[:socket] : @property_hash[:socket]
        PuppetX::Vmhost.socket_path(explicit)
      end

      private

      # A changing call with its own timeout; any failure fails the resource (puppet_error).
      def send_call(method, params, timeout)
        self.class.client(socket, timeout).call(method, params)
      rescue PuppetX::Vmhost::Error => e
        raise puppet_error(e)
      end

      # The client's message (a daemon refusal carries its code, kind, field and details),
      # with what the provider adds for a refusal.
      def puppet_error(err)
        text = err.message.dup
        text << refusal_detail(err).to_s if err.is_a?(PuppetX::Vmhost::DaemonError)
        Puppet::Error.new(text)
      end
    end
  end
end
